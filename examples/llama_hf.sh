#!/usr/bin/env bash
# A small Llama, end to end: a BPE tokenizer trained on the built-in corpus,
# ZeRO-3 training on 4 CPU ranks, export in Hugging Face format, and text
# generated from the export by transformers.
#
#   examples/llama_hf.sh                  # into runs/llama-hf (a few minutes)
#   STEPS=20 examples/llama_hf.sh /tmp/x  # shorter
#
# Needs mpishard with tokenizers (pip install 'mpishard[tokens]') and, for the
# last step only, torch and transformers.
set -euo pipefail
out=${1:-runs/llama-hf}
py=${PYTHON:-python}
mpiexec=${MPIEXEC:-mpiexec}
np=${NP:-4}
steps=${STEPS:-300}
bytes=${MAX_BYTES:-2000000}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

echo "== 1. tokenize $bytes bytes of the built-in corpus with a BPE trained on them"
"$py" -m mpishard prepare default "$out/data" --train-bpe 2048 --max-bytes "$bytes" \
    --progress false --overwrite true

echo "== 2. train a small Llama on $np ranks, ZeRO-3"
"$mpiexec" -n "$np" "$py" -m mpi4py -m mpishard train --preset llama-tiny --block-size 128 \
    --data "$out/data" --strategy zero3 --steps "$steps" --batch-size 8 --lr 3e-3 \
    --eval-interval "$steps" --checkpoint-dir "$out/checkpoints" --overwrite true \
    --progress false

echo "== 3. export the checkpoint as a Hugging Face folder"
"$py" -m mpishard checkpoint export "$out/checkpoints" "$out/hf" --format hf
cp "$out/data/tokenizer.json" "$out/hf/tokenizer.json"

echo "== 4. generate with transformers (nothing of mpishard imported)"
"$py" - "$out/hf" "def main(" <<'PY'
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

folder, prompt = Path(sys.argv[1]), sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(folder)
tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
ids = tokenizer(prompt, return_tensors="pt").input_ids
torch.manual_seed(0)
out = model.generate(ids, max_new_tokens=40, do_sample=True, top_k=40, pad_token_id=0)
print(f"{type(model).__name__} with {model.num_parameters():,} parameters from {folder}:")
print(tokenizer.decode(out[0]))
PY
