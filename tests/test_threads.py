"""The CPU thread tuner of ``lazytrain train``: it keeps the fastest count and follows a changing machine."""

from lazytrain.app.threads import ThreadTuner


def _run(tuner: ThreadTuner, speed: dict[int, float], steps: int) -> None:
    for _ in range(steps):
        tuner.observe(speed[tuner.current])


def test_tuner_keeps_the_fastest_count_and_retries():
    applied: list[int] = []
    tuner = ThreadTuner(2, applied.append, start=1, probe=5, settle=1, every=20)
    _run(tuner, {1: 0.20, 2: 0.12}, 15)             # idle machine: 2 threads are faster
    assert tuner.current == 2 and applied == [2]
    assert tuner.history[0][1] == {1: 0.20, 2: 0.12}
    _run(tuner, {1: 0.20, 2: 0.50}, 40)             # another job took a core: back to 1
    assert tuner.current == 1 and applied == [2, 1]
    assert len(tuner.history) == 2


def test_one_core_never_switches():
    applied: list[int] = []
    tuner = ThreadTuner(1, applied.append)
    _run(tuner, {1: 0.1}, 100)
    assert tuner.current == 1 and applied == [] and tuner.history == []


def test_settling_steps_are_not_timed():
    tuner = ThreadTuner(2, lambda n: None, start=2, probe=3, settle=2, every=100)
    times = iter([0.1] * 3 + [9.9, 9.9] + [0.3] * 3)   # the two steps right after a switch are slow
    for _ in range(8):
        tuner.observe(next(times))
    assert tuner.history[0][1] == {2: 0.1, 1: 0.3}
