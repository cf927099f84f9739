"""Request drivers of ``bench_tiers.py``: the chat workload's arrival models, and a paired run
that interleaves several engines step by step so that they meet the same machine load.

Arrival models:

- ``waves``: turn t of every conversation is submitted at once (in a seeded shuffled order);
  the next wave starts when the whole wave is answered.
- ``closed``: ``concurrency`` conversations in flight (seeded order); each submits its next turn
  when its previous answer finishes, after a think time (``think_ms``: the mean of a seeded
  exponential draw per turn, the same draws for every engine; 0 = at once, a saturated loop);
  a conversation that ends makes room for the next one. With think time, an engine that has
  nothing in flight jumps its clock to the next submission (idle time is not step time, and
  no TTFT spans it).

Clocks: each engine has its own clock that advances by the wall time of its own steps only
(schedule, tier moves, forward, sampling: ``engine.step()``). A request's TTFT is that clock
at the end of the step that produced its first token minus the clock when it was submitted.
Run alone, this is the wall-clock TTFT (``RequestOutput.metrics``) less the driver's own few
microseconds; run paired, the engines' steps alternate, so a load swing on the shared machine
lands on both (sequential runs minutes apart met load averages from 1.5 to 25: docs/tiers.md).
"""

from __future__ import annotations

import heapq
import time

import numpy as np


class ChatDriver:
    """One engine's conversations: submits turns, collects answers and TTFTs."""

    def __init__(self, llm, params, args, systems, convs, only_last=False) -> None:
        self.llm, self.eng, self.params = llm, llm.engine, params
        self.convs, self.turns = convs, args.turns
        self.arrival = getattr(args, "arrival", "waves")
        self.concurrency = getattr(args, "concurrency", len(convs))
        self.reference = getattr(args, "reference", None) if only_last else None
        self.order = np.random.default_rng(args.seed + 1)
        self.history = [list(systems[c % len(systems)]) for c in range(len(convs))]
        self.turn = [0] * len(convs)
        self.clock = 0.0  # seconds of this engine's own steps (plus idle jumps, think time)
        self.idle = 0.0  # seconds the clock jumped while every user was thinking
        self.inflight: dict[str, tuple[int, list[int], float]] = {}
        self.first: dict[str, float] = {}  # request id -> virtual TTFT
        self.outputs: dict[tuple[int, int], list[int]] = {}
        self.ttft: list[float] = []  # virtual (own-clock) TTFT, in completion order
        self.ttft_wall: list[float] = []  # RequestOutput.metrics TTFT
        self.prompt_tokens = 0
        self.wave = 0
        self.todo: list[int] = []
        # think time before turn t of conversation c (t >= 1), drawn once per workload so that
        # paired engines see the same draws whatever order their answers finish in
        mean = getattr(args, "think_ms", 0.0) / 1e3
        think = np.random.default_rng(args.seed + 2).exponential(1.0, (len(convs), args.turns))
        self.think = think * mean
        self.pending: list[tuple[float, int]] = []  # (clock due, conversation), a heap
        if self.arrival == "waves":
            self._next_wave()
        else:
            self.todo = self.order.permutation(len(convs)).tolist()
            for _ in range(min(self.concurrency, len(self.todo))):
                self._submit(self.todo.pop(0))

    def _submit(self, c: int, arrived: float | None = None) -> None:
        self.history[c] += self.convs[c][self.turn[c]]
        prompt = list(self.history[c])
        (rid,) = self.eng.add_requests([prompt], self.params)
        self.inflight[rid] = (c, prompt, self.clock if arrived is None else arrived)

    def _next_wave(self) -> None:
        while self.wave < self.turns:
            order = self.order.permutation(len(self.convs)).tolist()
            t, self.wave = self.wave, self.wave + 1
            if self.reference is not None and t < self.turns - 1:
                for c in order:  # replay of process 1's answers (identical greedy tokens)
                    self.history[c] += self.convs[c][t] + self.reference[(c, t)]
                    self.turn[c] += 1
                continue
            for c in order:
                self._submit(c)
            return

    @property
    def done(self) -> bool:
        return not self.inflight and not self.pending

    def _release_due(self) -> None:
        if self.pending and not self.inflight:  # idle: the next user is still thinking
            jump = max(0.0, self.pending[0][0] - self.clock)
            self.clock += jump
            self.idle += jump
        while self.pending and self.pending[0][0] <= self.clock:
            due, c = heapq.heappop(self.pending)
            self._submit(c, arrived=due)

    def step(self) -> None:
        """One engine step; advances the clock, records first tokens and answers."""
        self._release_due()
        start = time.perf_counter()
        outs = self.eng.step()
        self.clock += time.perf_counter() - start
        for rid, (_, _, arrived) in self.inflight.items():
            if rid not in self.first:
                req = self.eng._requests.get(self.eng._ids.get(rid, -1))
                if req is not None and req.metrics.first_token_time is not None:
                    self.first[rid] = self.clock - arrived
        for o in outs:
            if not o.finished or o.request_id not in self.inflight:
                continue
            c, prompt, arrived = self.inflight.pop(o.request_id)
            self.outputs[(c, self.turn[c])] = list(o.outputs[0].token_ids)
            self.history[c] += self.outputs[(c, self.turn[c])]
            self.prompt_tokens += len(prompt)
            self.ttft.append(self.first.pop(o.request_id, self.clock - arrived))
            if o.metrics.time_to_first_token is not None:
                self.ttft_wall.append(o.metrics.time_to_first_token)
            self.turn[c] += 1
            if self.arrival == "closed":
                if self.turn[c] < self.turns:
                    if self.think[c, self.turn[c]] > 0:
                        heapq.heappush(self.pending, (self.clock + self.think[c, self.turn[c]], c))
                    else:
                        self._submit(c)
                elif self.todo:
                    self._submit(self.todo.pop(0))
        if self.arrival == "waves" and not self.inflight:
            self._next_wave()


def run(drivers: list[ChatDriver]) -> None:
    """Steps every unfinished driver in turn (one step each) until all are done."""
    while True:
        live = [d for d in drivers if not d.done]
        if not live:
            return
        for d in live:
            d.step()
