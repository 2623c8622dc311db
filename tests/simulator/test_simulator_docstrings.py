"""The Examples in the public API's docstrings (Google style, rendered by the docs' API reference) run and say
what they show."""

import dataclasses
import doctest

import lioncub.simulator as sim
import pytest

PUBLIC = [sim.Cluster, sim.Cluster.for_ranks, sim.StepSpec, sim.simulate_step, sim.simulate_collective, sim.sweep]


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda o: o.__qualname__)
def test_the_example_runs(obj):
    assert "Args:" in obj.__doc__ and "Example:" in obj.__doc__
    if not isinstance(obj, type):
        assert "Returns:" in obj.__doc__
    tests = doctest.DocTestFinder(recurse=False).find(obj, globs={**vars(sim), "dataclasses": dataclasses})
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for t in tests:
        runner.run(t)
    assert runner.summarize(verbose=False).failed == 0
