"""Continuous batching: which requests run in the next forward, and what their results do.

    waiting queue ─policy.py─▶ PrefillAdder (prefill.py) ─▶ ScheduleBatch (schedule_batch.py) ─▶ ModelRunner
    running batch ─decode.py (retraction when pages run out)─▶ ScheduleBatch ─▶ ModelRunner
    BatchResult ─OutputProcessor (output.py)─▶ finish checks, text, stop strings ─▶ Req.on_output

Scheduler (scheduler.py) owns the queues and runs the loop body, one step per call. With overlap
scheduling (overlap.py, the default) a step launches batch N+1 before it processes batch N's results,
so the CPU's per-step work runs while the device computes.
"""
