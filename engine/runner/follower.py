"""A follower rank of a tensor-parallel engine: `python -m engine.runner.follower`, started by rank 0.

    stdin: FollowerSpec (engine.parallel.launch) ─▶ join rank 0's group ─▶ ModelRunner (this rank's shard of
    the weights, a KV pool of the same slots with this rank's heads) ─▶ follow rank 0's steps ─▶ exit

It owns no scheduler, cache, allocator or sampler of consequence: everything it runs, rank 0 decided and
broadcast (engine.parallel.step). It ignores SIGINT (rank 0's process handles Ctrl-C) and exits when rank 0
stops the group, when a collective with rank 0 fails (exit code 1), or when rank 0's process is gone.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import signal
import sys
import threading

import torch

from engine.models.source import resolve_model
from engine.parallel.launch import FollowerSpec, exit_with_parent, join_group
from engine.parallel.step import RankCall, StepInputs, receive_step
from engine.runner.model_runner import ModelRunner, resolve_device

logger = logging.getLogger(__name__)


def follow(runner: ModelRunner) -> None:
    """Run rank 0's steps on this rank's shard, in order, until rank 0 stops the group."""
    while True:
        step = receive_step(runner.tp)
        if step is None:
            return
        if isinstance(step, RankCall):
            run_call(runner, step)
        else:
            run_step(runner, step)


def run_call(runner: ModelRunner, call: RankCall) -> None:
    """One of rank 0's calls (engine.parallel.step.send_call): `call.module.call.function(runner, *call.args)`.
    It runs in the step loop, so it must return quickly (hand long work to a thread of its own); what it
    raises ends this rank."""
    getattr(importlib.import_module(call.module), call.function)(runner, *call.args)


@torch.inference_mode()
def run_step(runner: ModelRunner, step: StepInputs) -> None:
    """One of rank 0's steps: its table writes, the forward, and the compute_logits calls rank 0 makes after
    it (to join their all-gathers; only rank 0 samples). A DECODE step rank 0 runs as a CUDA graph replays
    this rank's graph of the same size (forward and logits, collectives included)."""
    if step.table_edits.numel():
        runner.req_to_token_pool.write_positions(*step.table_edits)
    fb = step.forward_batch
    fb.attn_backend = runner.backend_for(fb)  # the kernels rank 0 runs for this step
    graphs = runner.graph_runner
    if graphs is not None and graphs.can_run(fb):  # rank 0 replays its graph of this size: so does this rank
        graphs.replay(fb)
        return
    fb.attn_backend.init_forward_metadata(fb)
    with runner.pdl_scope(fb):
        hidden = runner.model(fb)
        for start, n in step.logit_segments:
            runner.model.compute_logits(hidden[start : start + n])
        if step.num_sampled:
            runner.model.compute_logits(hidden[fb.last_token_rows[: step.num_sampled]])


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec: FollowerSpec = pickle.load(sys.stdin.buffer)
    logging.basicConfig(
        level=spec.log_level, format=f"%(asctime)s %(levelname)s tp-rank{spec.rank}[%(process)d] %(name)s: %(message)s"
    )
    threading.Thread(target=exit_with_parent, args=(spec.parent_pid,), daemon=True).start()
    base = resolve_device(spec.config.device)
    if base.type == "cpu":  # the ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
    runner = None
    try:
        tp = join_group(spec, base)
        runner = ModelRunner(spec.config, resolve_model(spec.config.model), tp=tp)
        follow(runner)
    except BaseException:  # noqa: BLE001 - rank 0 sees this rank's exit and names it
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        os._exit(1)
    runner.close()


if __name__ == "__main__":
    main()
