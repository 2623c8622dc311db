"""Autotune's convergence-risk rule as research: fitting it to the convergence map and checking it (fit.py),
pre-registering its calls and reporting them (preregister.py), and the `python -m research risk` command
(cli.py). The rule autotune reads at run time stays in lioncub.apps.autotune.risk_rule."""
