"""The GPU is bound before MPI starts ([Note: GPU before MPI] in mpishard/__main__.py).

On CPU with a stand-in CuPy: the launcher's node-local rank is parsed,
``python -m mpishard`` makes GPU ``local_rank % GPUs`` current before
anything imports ``mpi4py.MPI``, and after MPI starts ``node_local_rank``
warns, naming both, when MPI's node-local rank disagrees.
"""
import importlib.machinery
import json
import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
from mpi4py import MPI

import mpishard.__main__ as entry
from ckpt_scripts.common import ROOT, clean_env
from mpishard.comm import launch, node_local_rank

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("environ,expected", [
    ({}, None),
    ({"SLURM_LOCALID": "3"}, (3, "SLURM_LOCALID")),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, (1, "OMPI_COMM_WORLD_LOCAL_RANK")),
    ({"MPI_LOCALRANKID": "2"}, (2, "MPI_LOCALRANKID")),
    ({"PMI_LOCAL_RANK": "5"}, (5, "PMI_LOCAL_RANK")),
    # a Slurm batch step's SLURM_LOCALID=0 is inherited by mpiexec's ranks: Hydra's wins
    ({"SLURM_LOCALID": "0", "MPI_LOCALRANKID": "3"}, (3, "MPI_LOCALRANKID")),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": " 7 ", "PMI_LOCAL_RANK": "1"},
     (7, "OMPI_COMM_WORLD_LOCAL_RANK")),
    ({"SLURM_LOCALID": "", "PMI_LOCAL_RANK": "x", "MPI_LOCALRANKID": "-1"}, None),
])
def test_launcher_local_rank(environ, expected):
    assert entry.launcher_local_rank(environ) == expected


def test_wants_gpu_from_the_command_line_and_the_config(tmp_path):
    assert entry.wants_gpu(["train", "--backend", "cupy"])
    assert entry.wants_gpu(["bench", "comm", "--backend=auto"])
    assert entry.wants_gpu(["info"])
    assert not entry.wants_gpu(["train", "--backend", "numpy"])
    assert not entry.wants_gpu(["estimate", "--strategy", "zero3"])
    gpu_cfg = tmp_path / "gpu.toml"
    gpu_cfg.write_text('[run]\nbackend = "cupy"\n')
    assert entry.wants_gpu(["train", "--config", str(gpu_cfg)])
    assert not entry.wants_gpu(["train", "--config", str(gpu_cfg), "--backend", "numpy"])
    assert not entry.wants_gpu(["train", "--config", str(tmp_path / "missing.toml")])


class FakeCupy(types.ModuleType):
    def __init__(self, gpus):
        super().__init__("cupy")
        self.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
        self.used = []
        used = self.used

        class Device:
            def __init__(self, index):
                self.index = index

            def use(self):
                used.append((self.index, "mpi4py.MPI" in sys.modules))

        self.cuda = types.SimpleNamespace(
            Device=Device, runtime=types.SimpleNamespace(getDeviceCount=lambda: gpus))


def test_bind_device_before_mpi(monkeypatch):
    fake = FakeCupy(gpus=4)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    environ = {"MPI_LOCALRANKID": "6", entry.DEVICE_BEFORE_MPI: "stale"}
    # in this process MPI is already imported: too late to bind, and nothing is recorded
    assert entry.bind_device_before_mpi(["train", "--backend", "cupy"], environ) is None
    assert entry.DEVICE_BEFORE_MPI not in environ and fake.used == []
    monkeypatch.delitem(sys.modules, "mpi4py.MPI")  # as in a fresh process
    assert entry.bind_device_before_mpi(["train"], environ) is None  # NumPy: no context
    record = entry.bind_device_before_mpi(["train", "--backend", "cupy"], environ)
    assert record == {"device": 2, "gpus": 4, "local_rank": 6, "source": "MPI_LOCALRANKID",
                      "pid": os.getpid()}
    assert fake.used == [(2, False)] and json.loads(environ[entry.DEVICE_BEFORE_MPI]) == record
    assert entry.bind_device_before_mpi(["info"], {}) is None  # no launcher
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy(gpus=0))
    assert entry.bind_device_before_mpi(["info"], {"SLURM_LOCALID": "1"}) is None


def test_node_local_rank_names_both_when_they_differ(monkeypatch):
    record = {"device": 1, "gpus": 2, "local_rank": 1, "source": "SLURM_LOCALID",
              "pid": os.getpid()}
    monkeypatch.setenv("MPISHARD_DEVICE_BEFORE_MPI", json.dumps(record))
    assert launch.device_before_mpi() == record
    with pytest.warns(RuntimeWarning, match=r"the launcher's node-local rank is 1 "
                                            r"\(SLURM_LOCALID\), and GPU 1 was made current "
                                            r"before MPI started, but MPI's node-local rank "
                                            r"is 0, which binds GPU 0"):
        assert node_local_rank(MPI.COMM_SELF) == 0
    monkeypatch.setenv("MPISHARD_DEVICE_BEFORE_MPI", json.dumps({**record, "local_rank": 0,
                                                                  "device": 0}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert node_local_rank(MPI.COMM_SELF) == 0   # they agree: silent
        monkeypatch.setenv("MPISHARD_DEVICE_BEFORE_MPI", json.dumps({**record, "pid": 1}))
        assert launch.device_before_mpi() is None    # another process's record
        node_local_rank(MPI.COMM_SELF)


def test_python_m_mpishard_binds_before_importing_mpi(tmp_path):
    package = tmp_path / "cupy"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent('''
        import json, os, sys
        __version__ = "0.0 (a stand-in)"

        class _Runtime:
            @staticmethod
            def getDeviceCount():
                return 2

        class Device:
            def __init__(self, index=0):
                self.index = index

            def use(self):
                with open(os.environ["FAKE_CUPY_LOG"], "a") as log:
                    log.write(json.dumps({"device": self.index,
                                          "mpi_imported": "mpi4py.MPI" in sys.modules}) + "\\n")

        class cuda:
            runtime = _Runtime
            Device = Device
    '''))
    env = clean_env(FAKE_CUPY_LOG=str(tmp_path / "log"), SLURM_LOCALID="1")
    for var in entry.LOCAL_RANK_VARS[:-1]:
        env.pop(var, None)
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
    proc = subprocess.run([sys.executable, "-m", "mpishard", "info"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    used = [json.loads(line) for line in (tmp_path / "log").read_text().splitlines()]
    assert used[0] == {"device": 1, "mpi_imported": False}  # before MPI, GPU 1 of 2
    assert "bound before MPI: cuda:1 (SLURM_LOCALID=1)" in proc.stdout, proc.stdout
    assert ("the launcher's node-local rank is 1 (SLURM_LOCALID)" in proc.stderr
            and "MPI's node-local rank is 0" in proc.stderr), proc.stderr
