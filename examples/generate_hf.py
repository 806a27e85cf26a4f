"""Generate text from a Hugging Face folder with ``transformers`` alone.

    python examples/generate_hf.py runs/llama-hf/hf --prompt "def main("

The folder is one ``mpishard checkpoint export --format hf`` wrote, with the
``tokenizer.json`` of the data beside it (examples/llama_hf.sh puts it there).
Nothing of mpishard is imported: this is what a user of the Hugging Face stack
does with the model.
"""
import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    folder = Path(args.folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    torch.manual_seed(args.seed)
    out = model.generate(ids, max_new_tokens=args.tokens, do_sample=True, top_k=40,
                         pad_token_id=0)
    print(f"{type(model).__name__} with {model.num_parameters():,} parameters from {folder}:")
    print(tokenizer.decode(out[0]))


if __name__ == "__main__":
    main()
