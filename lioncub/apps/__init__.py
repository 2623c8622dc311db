"""The applications built on the optimizer and the simulator: autotune, the benchmarks, calibration, the
emulated-Ethernet lab, the training CLI and the demo. Each `lioncub` command lives in one of them."""
