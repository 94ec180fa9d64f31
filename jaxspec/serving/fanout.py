"""Serving across processes: process 0 decides, every process runs the same plans in the same order.

A multi-process server is one program over several processes (multi-controller SPMD): every process must call the
same compiled programs with the same shapes in the same order, or the collectives inside them deadlock. So only
process 0 runs HTTP and the scheduler; each plan it is about to run goes to the other processes first, through JAX's
own coordination service (the key-value store `jax.distributed` already runs, one key per message, as
jax-llm-examples' serving loop does): no extra port, no fixed-size payload. The other processes block on the next
key (an idle server spins nothing) and run what they get on their executor.

Messages are a serialised `StepPlan`, `RESET` (a step failed on process 0: every executor starts clean) or `STOP`
(process 0 is shutting down: every process leaves the run together, then the followers return). A follower that
loses process 0 (the coordination service lives there) gets an error from the store and exits with a message naming
process 0.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("jaxspec.serving")

PREFIX = "jaxspec/serve/"
STOP = b"stop"
RESET = b"reset"
KEEP = 16  # messages kept in the store behind the newest (followers run in lockstep, at most a step behind)


class PlanChannel:
    """Process 0 publishes, every other process receives, message by message in order. `client`: JAX's distributed
    runtime client (default: the one `jax.distributed.initialize` started)."""

    def __init__(self, client=None, *, poll_s: float = 30.0):
        if client is None:
            from jax._src import distributed

            client = distributed.global_state.client
            if client is None:
                raise RuntimeError("PlanChannel: jax.distributed is not initialized (run with --coordinator ...)")
        self.client, self.poll_ms = client, int(poll_s * 1000)
        self.sent = self.received = 0

    def publish(self, message: bytes) -> None:
        """Process 0: the next message (every follower reads it before it runs anything after it)."""
        self.client.key_value_set_bytes(f"{PREFIX}{self.sent}", message)
        if self.sent >= KEEP:
            self.client.key_value_delete(f"{PREFIX}{self.sent - KEEP}")
        self.sent += 1

    def receive(self) -> bytes:
        """A follower: the next message, waiting as long as it takes (process 0 idles between requests); raises
        `LostLeader` when the store (on process 0) is gone."""
        key = f"{PREFIX}{self.received}"
        while True:
            try:
                message = self.client.blocking_key_value_get_bytes(key, self.poll_ms)
                break
            except Exception as e:  # a timeout (idle leader) or a lost coordination service (dead leader)
                if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                    continue
                raise LostLeader(f"lost process 0 (the coordination service) while waiting for {key}: {e}") from e
        self.received += 1
        return message

    def close(self) -> None:
        """Leave the run: every process calls this after STOP (JAX's shutdown waits for all of them, so process 0's
        coordination service outlives every follower's last call to it)."""
        import jax

        jax.distributed.shutdown()


class LostLeader(RuntimeError):
    """Process 0 is gone: a follower cannot go on (its next collective would never complete)."""


def follow(executor, channel: PlanChannel) -> int:
    """Run process 0's plans on this process's `executor` until it says STOP; returns the plans run."""
    from jaxspec.serving.plan import StepPlan

    runs, start = 0, time.perf_counter()
    while True:
        message = channel.receive()
        if message == STOP:
            log.info("process 0 stopped: %d plans run in %.1fs", runs, time.perf_counter() - start)
            channel.close()
            return runs
        if message == RESET:
            executor.reset()
            continue
        executor.run(StepPlan.from_bytes(message))
        runs += 1
