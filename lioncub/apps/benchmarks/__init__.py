"""Benchmarks: `lioncub bench {step,kernels,simulator,train,convergence}` (speed and accuracy targets live
here, not in timed tests). The convergence map and pooled runs are the research tools'
(`python -m research bench`, outside the package).

* step.py       the optimizer step per method on local Gloo ranks, beside a plain local Lion step
* kernels.py    the codec kernels' throughput against the device's copy bandwidth
* simulator.py  the simulator's own wall time on a large collective and a large training step
* train.py      every method trained on the lab (train) or on local ranks (convergence)
* cli.py        the `lioncub bench` command; it imports a benchmark's module only when that one runs

Importing this package imports nothing else (in particular not torch).
"""
