"""Hypothesis stateful test: the bindings against the pure-Python reference, op by op."""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from manager_driver import Driver

TOKEN = st.integers(0, 3)
PROMPT = st.lists(TOKEN, min_size=1, max_size=24)
REQUEST = st.tuples(PROMPT, st.integers(0, 6), st.integers(0, 1))  # prompt, extra, namespace


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 40),
        block_size=st.sampled_from([1, 2, 4]),
        mode=st.sampled_from(["radix", "hash", "off"]),
    )
    def setup(self, num_blocks, block_size, mode):
        self.d = Driver(num_blocks, block_size, mode)

    def live(self):
        return sorted(self.d.tokens)

    @rule(
        batch=st.lists(
            st.tuples(PROMPT, st.integers(0, 6), st.integers(0, 1)), min_size=1, max_size=3
        ),
        wm=st.integers(0, 2),
    )
    def admit(self, batch, wm):
        if all(len(p) + e <= self.d.ref.max_tokens for p, e, _ in batch):
            prompts, extra, ns = (list(x) for x in zip(*batch, strict=True))
            self.d.admit(prompts, extra, ns, wm)

    @precondition(lambda self: self.d.tokens)
    @rule(data=st.data())
    def allocate(self, data):
        reqs = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=3))
        grow = [data.draw(st.integers(1, 9)) for _ in reqs]
        if all(
            self.d.covered(r) + g <= self.d.ref.max_tokens for r, g in zip(reqs, grow, strict=True)
        ):
            self.d.allocate(reqs, grow)

    @precondition(lambda self: self.d.tokens)
    @rule(data=st.data())
    def cache(self, data):
        self.d.cache(data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=3)))

    @precondition(lambda self: self.d.tokens)
    @rule(data=st.data())
    def fork(self, data):
        self.d.fork([data.draw(st.sampled_from(self.live()))])

    @precondition(lambda self: self.d.tokens)
    @rule(data=st.data(), with_tokens=st.booleans())
    def free(self, data, with_tokens):
        reqs = data.draw(
            st.lists(st.sampled_from(self.live()), min_size=1, max_size=2, unique=True)
        )
        self.d.free(reqs, with_tokens)

    @rule()
    def drain(self):
        self.d.drain()

    @invariant()
    def agrees_with_reference(self):
        self.d.compare()


ManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_manager_machine = ManagerMachine.TestCase
