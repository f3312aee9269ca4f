"""The draft gate drafts where steps with drafts have given more tokens per second than steps
without, per size class of steps, and keeps trying the other way now and then."""

from __future__ import annotations

import itertools

from engine.core import engine_core
from engine.core.draft_gate import DraftGate, size_class
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.speculation import Drafter, SpeculativeConfig
from tests.helpers import reference_greedy, tiny_core, tiny_llama


def decisions(gate: DraftGate, rows: int, count: int) -> list[bool]:
    return [gate.drafts(rows) for _ in range(count)]


def test_size_classes_double():
    assert [size_class(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 63, 64, 65)] == [
        0,
        0,
        1,
        2,
        2,
        3,
        3,
        4,
        6,
        6,
        7,
    ]


def test_a_size_class_measures_both_ways_first():
    gate = DraftGate()
    assert not gate.drafts(4)  # until a step without drafts is seen
    assert not gate.drafts(4)
    gate.observe(4, drafted=False, tokens=4, seconds=0.01)
    assert gate.drafts(4) and gate.drafts(4)  # until a step with drafts is seen
    gate.observe(4, drafted=True, tokens=9, seconds=0.012)
    assert gate.drafts(4)
    assert not gate.drafts(1)  # another size class starts over


def test_the_faster_way_wins_in_its_own_size_class_and_the_other_is_tried_less_and_less():
    gate = DraftGate()
    for _ in range(5):
        gate.observe(1, drafted=True, tokens=3, seconds=0.01)  # 300 tok/s
        gate.observe(1, drafted=False, tokens=1, seconds=0.008)  # 125 tok/s
        gate.observe(32, drafted=True, tokens=60, seconds=0.2)  # 300 tok/s
        gate.observe(32, drafted=False, tokens=32, seconds=0.05)  # 640 tok/s
    small = decisions(gate, 1, 200)
    large = decisions(gate, 30, 200)
    # Tries of the other way after 8, then 8, 16, 32, 64, 128 decisions.
    tries = [i + 1 for i, drafted in enumerate(large) if drafted]
    assert tries == [8, 16, 32, 64, 128]
    assert [i + 1 for i, drafted in enumerate(small) if not drafted] == tries
    drafted, plain = gate.rates(30)
    assert drafted is not None and plain is not None and drafted < plain


def test_rates_follow_the_traffic():
    gate = DraftGate()
    gate.observe(2, drafted=True, tokens=2, seconds=0.01)
    gate.observe(2, drafted=False, tokens=2, seconds=0.005)
    assert not gate.drafts(2)
    for _ in range(20):  # drafts start being kept
        gate.observe(2, drafted=True, tokens=8, seconds=0.01)
    assert gate.drafts(2)
    gate.observe(2, drafted=False, tokens=2, seconds=1.0)  # one stalled step turns nothing
    assert gate.drafts(2)


def served(
    gate: DraftGate, rows: int, count: int, drafted_rate: float, plain_rate: float
) -> list[bool]:
    """`count` decisions, each followed by its step's rate (one step = one second)."""
    taken = []
    for _ in range(count):
        drafts = gate.drafts(rows)
        gate.observe(rows, drafts, round(drafted_rate if drafts else plain_rate), 1.0)
        taken.append(drafts)
    return taken


def test_a_try_that_wins_turns_the_gate_at_once_and_a_close_loss_is_tried_again_soon():
    gate = DraftGate()
    # Replies that stopped repeating: drafted steps a little slower (drafts missed).
    steps = served(gate, 1, 100, drafted_rate=144, plain_rate=160)
    tries = [i for i, drafted in enumerate(steps) if drafted][2:]
    assert all(b - a == 8 for a, b in itertools.pairwise(tries)), tries
    # They repeat again: the next try wins, and the gate drafts from the step after it (until
    # it tries the other way).
    steps = served(gate, 1, 20, drafted_rate=900, plain_rate=160)
    first = steps.index(True)
    assert first < 8 and all(steps[first : first + 8])
    # A way far slower is tried less and less often, as before.
    far = DraftGate()
    tries = [i for i, d in enumerate(served(far, 1, 300, drafted_rate=50, plain_rate=160)) if d]
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert gaps[-1] >= 64 and gaps == sorted(gaps)


class KnownDrafter(Drafter):
    """Drafts the request's known greedy continuation, as far as the gate lets it."""

    def __init__(self, truth: list[int]) -> None:
        super().__init__(SpeculativeConfig(3, 1, 1))
        self.truth = truth

    def draft(self, request: Request) -> None:
        done = request.num_output_tokens
        request.draft_token_ids = self.truth[done : min(done + 3, request.max_output_tokens - 1)]


class SteppedClock:
    """The engine's clock: a microsecond a reading, plus what a step is made to last, so that
    the steps' times are the same on any machine, however loaded."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 1e-6
        return self.now


def slowed_engine(slow_drafted: bool, truth: list[int], clock: SteppedClock):
    """An engine whose steps with drafts (or without) take 30 ms more on its clock: the gate
    must learn which way is faster from the steps alone."""
    core, _ = tiny_core(tiny_llama(), speculative=SpeculativeConfig(3, 1, 1))
    core.drafter = KnownDrafter(truth)
    execute = core.runner.execute
    drafted_steps: list[bool] = []

    def slowed(scheduled):
        drafted = any(item.drafts for item in scheduled.scheduled)
        if all(item.num_tokens == 1 or item.drafts for item in scheduled.scheduled):
            drafted_steps.append(drafted)
        if drafted == slow_drafted:
            clock.now += 0.03
        return execute(scheduled)

    core.runner.execute = slowed
    return core, drafted_steps


def test_an_engine_stops_drafting_where_drafted_steps_are_slower_and_keeps_on_where_faster(
    monkeypatch,
):
    prompt = [7, 8, 9] * 6
    truth = reference_greedy(tiny_llama(), prompt, 90)
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    clock = SteppedClock()
    monkeypatch.setattr(engine_core, "time", clock)
    shares = {}
    for slow_drafted in (True, False):
        core, drafted_steps = slowed_engine(slow_drafted, truth, clock)
        core.add_request("r", prompt, params)
        while core.has_unfinished():
            core.step()
        later = drafted_steps[len(drafted_steps) // 2 :]
        shares[slow_drafted] = sum(later) / len(later)
    # The other way is tried now and then.
    assert shares[True] <= 0.2 and shares[False] >= 0.8


def test_a_step_that_tries_drafts_drafts_two_tokens_a_request_at_most():
    drafter = Drafter(SpeculativeConfig(8, 1, 1))
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 5]

    def drafted() -> list[int]:
        request = Request("r", list(prompt), SamplingParams(max_tokens=50), 0.0, 100)
        drafter.draft_step([request], running=1)
        return request.draft_token_ids

    assert drafted() == []  # a step without drafts is measured first
    drafter.observe(1, drafted=False, tokens=1, seconds=0.01)
    assert drafted() == [6, 7]  # the first step with drafts tries them
    drafter.observe(1, drafted=True, tokens=3, seconds=0.01)
    assert drafted() == [6, 7, 8, 9, 10, 11, 12, 13]  # faster with them: drafts in full


def test_suffix_drafts_likely_kept_turn_a_plain_step_into_a_try_once_in_eight():
    drafter = Drafter(SpeculativeConfig.of({"method": "suffix", "num_speculative_tokens": 8}))
    for _ in range(3):  # steps with drafts have been slower: the gate favours plain ones
        drafter.observe(1, drafted=True, tokens=1, seconds=0.02)
        drafter.observe(1, drafted=False, tokens=1, seconds=0.01)
    assert drafter.suffix is not None
    drafter.suffix.observe("earlier", [])
    drafter.suffix.observe("earlier", [20, 21, 22, 23, 24, 25, 26, 27])
    drafter.release(["earlier"])

    def drafts(prompt: list[int]) -> list[int]:
        request = Request("r", prompt, SamplingParams(max_tokens=50), 0.0, 100)
        drafter.draft_step([request], running=1)
        drafter.release(["r"])
        return request.draft_token_ids

    assert drafts([9, 20, 21, 22]) == [23, 24]  # an earlier reply repeats: a try, two drafts
    assert drafts([9, 20, 21, 22]) == []  # not again for a while
    assert [drafts([5, 6, 7]) for _ in range(8)] == [[]] * 8  # nothing likely kept: no try
    assert drafts([9, 20, 21, 22]) == [23, 24]


def test_a_size_class_measured_only_with_drafts_measures_plain_before_any_try():
    # A step's rows can differ from those its drafts were decided at (requests finished or
    # joined), so a size class can see a drafted step before any decision of its own; the
    # suffix drafter's evidence then asks for a try before a plain step was measured.
    drafter = Drafter(SpeculativeConfig.of({"method": "suffix", "num_speculative_tokens": 8}))
    drafter.observe(6, drafted=True, tokens=12, seconds=0.01)
    assert drafter.suffix is not None
    drafter.suffix.observe("earlier", [])
    drafter.suffix.observe("earlier", [20, 21, 22, 23, 24, 25, 26, 27])
    drafter.release(["earlier"])
    requests = [
        Request(f"r{i}", [9, 20, 21, 22], SamplingParams(max_tokens=50), 0.0, 100) for i in range(6)
    ]
    drafter.draft_step(requests, running=6)
    assert [request.draft_token_ids for request in requests] == [[]] * 6  # plain, measured first
    assert drafter.gate.rates(6) == (1200.0, None)
