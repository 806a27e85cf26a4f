"""Checkpoint files and folders follow the umask, so a project group can read them."""
import os
import stat

import pytest
from mpi4py import MPI

from ckpt_scripts.common import build
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.comm import Communicator

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("umask", [0o002, 0o022, 0o077])
def test_checkpoint_modes_follow_the_umask(umask, tmp_path):
    comm = Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True)
    strategy = build("zero3", comm, "float32")
    before = os.umask(umask)
    try:
        root = save_checkpoint(tmp_path / "ckpt", 3, strategy, world=comm).parent
    finally:
        os.umask(before)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode)
             for p in [root, *root.rglob("*")]}
    assert {"ckpt", "ckpt/latest", "ckpt/step-3", "ckpt/step-3/rank-0.safetensors",
            "ckpt/step-3/manifest.json"} == set(modes)
    for name, mode in modes.items():
        expected = (0o777 if (tmp_path / name).is_dir() else 0o666) & ~umask
        assert mode == expected, f"{name}: {oct(mode)}, umask {oct(umask)}"
    load_checkpoint(root, strategy, world=comm)                  # still loads
