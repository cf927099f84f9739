"""The simulator runs the three systems on one stream and shows what paging buys."""

from kvcore.tools import sim


def test_paged_beats_reservation_on_the_same_stream(capsys):
    args = sim.parser().parse_args(["--seed", "3", "--requests", "150", "--num-blocks", "513"])
    paged, static, reserved = sim.compare(args)
    assert len(paged.latency) == len(static.latency) == len(reserved.latency) == 150
    # Paging wastes only the tail of each last block; reservations waste most of what they hold.
    assert sum(paged.waste) / len(paged.waste) < 0.1
    assert sum(reserved.waste) / len(reserved.waste) > 0.4
    assert paged.peak_running > reserved.peak_running
    assert paged.steps < reserved.steps < static.steps
    assert static.preemptions == reserved.preemptions == 0
    sim.main(["--seed", "3", "--requests", "150", "--num-blocks", "513"])
    out = capsys.readouterr().out
    assert "memory waste" in out and "paged (kvcore)" in out and "steps to drain" in out
