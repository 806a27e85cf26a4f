"""What a pipeline stage sends: it lets go of each output it sends (see [Note: sent
outputs] in mpishard/parallel/pipeline/schedule.py), under GPipe, 1F1B and interleaved
1F1B; without sequence parallelism each tp rank sends its block of the rows and the
receiver gathers the rest over tp (see [Note: scattered pipeline messages] there).

    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi tests/parallel/test_pipeline_sent_outputs.py

Every rank records the arrays its forwards hand to sends (weak references) and, after
each forward or backward it runs, checks that every output whose gradient had come
back before that op began is gone: the receiver had it, so the send had completed
and the schedule dropped it. The training itself equals one process's elsewhere
(tests/parallel/test_pipeline_interleaved.py, test_composition.py).
"""
import weakref

import numpy as np
import pytest

from mpishard.comm import Mesh
from mpishard.models import GPT, GPTConfig
from mpishard.parallel import ParallelModel
from mpishard.planning.layout import Layout, estimate_layout
from parity import sub_world

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=4, n_head=2, n_embd=12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_a_stage_lets_go_of_the_outputs_it_sent(schedule, chunks):
    with sub_world(2) as comm:
        if comm is None:
            return
        run = ParallelModel(GPT(CFG, dtype="float64", materialize_now=False), Mesh(comm, pp=2),
                            "ddp", micro_batches=4, schedule=schedule, virtual_stages=chunks)
        pipeline = run.pipeline
        sent, returned, running, held = {}, [], [], []
        isend, run_op = pipeline.pp.isend, pipeline._run

        def recording_isend(buf, dest, tag):
            kind, c, i = running[-1]
            if kind == "F":
                sent[c, i] = weakref.ref(buf)
            return isend(buf, dest, tag)

        def checked_run(step, kind, c, i):
            before = list(returned)           # gradients back before this op began
            running.append((kind, c, i))
            run_op(step, kind, c, i)
            held.extend((key, (kind, c, i)) for key in before
                        if key in sent and sent[key]() is not None)
            if kind == "B":
                returned.append((c, i))

        pipeline.pp.isend, pipeline._run = recording_isend, checked_run
        x = np.random.default_rng(0).integers(0, CFG.vocab_size, (8, CFG.block_size))
        loss = run.train_step(x, x)
        everyone = comm.all_gather_obj((held, len(sent)))     # every rank asserts alike
        assert np.isfinite(loss)
        assert all(not rank_held for rank_held, _ in everyone), \
            f"{schedule}: (output, after op) still held, per rank: {everyone}"
        # each rank's chunks but the model's last send their 4 micro-batches on
        assert [n for _, n in everyone] == [4 * chunks, 4 * (chunks - 1)]


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("seq_len", [8, 7])       # 7: rows that do not divide, sent whole
def test_messages_go_as_tp_blocks_without_sequence_parallelism(seq_len):
    with sub_world(4) as comm:
        if comm is None:
            return
        mesh, m, batch = Mesh(comm, tp=2, pp=2), 4, 4
        run = ParallelModel(GPT(CFG, dtype="float64", materialize_now=False), mesh, "ddp",
                            micro_batches=m)
        x = np.random.default_rng(0).integers(0, CFG.vocab_size, (batch, seq_len))
        mesh.pp.stats.reset()
        run.train_step(x, x)
        rows = batch // m * seq_len
        block = rows // 2 if rows % 2 == 0 else rows        # b T = 8 rows, or 7 whole
        # each micro-batch: one message each way (sent or received), and the loss broadcast
        assert mesh.pp.stats.total_bus_bytes == 2 * m * block * CFG.n_embd * 8 + 8
        plan = estimate_layout(GPT(CFG, dtype="float64", materialize_now=False),
                               Layout(tp=2, pp=2, strategy="ddp", batch_size=batch // m,
                                      seq_len=seq_len, micro_batches=m))
        assert plan.stages[mesh.pp_rank].bus_bytes["pp"] == mesh.pp.stats.total_bus_bytes
