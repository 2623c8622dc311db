"""Training configurations: how the model is wrapped (and so who communicates), and the optimizer.

A configuration is what `lioncub train --method` takes and what the benches and the demo compare, spelled

* `<method>`, a LionCub method ("vote-1bit", "allreduce", ...): the model as it is, LionCub does all the
  communication;
* `<wrapper>+lion` ("ddp+lion"): the model in a torch wrapper that communicates the gradients itself, plain
  Lion on every rank: what users run today, the baseline of the benches;
* `hsdp+<method>` ("hsdp+vote-1bit"): the model sharded by FSDP2 inside each node, LionCub's method across
  the nodes (lioncub.attach_fsdp); "hsdp+lion" is FSDP2's own HSDP (its all-reduce across nodes) with plain
  Lion, the sharded baseline.

`parse` turns the string into a `Configuration`; code asks its capabilities, never the string. A new wrapper
is one more `Wrapper` and its spellings in `CONFIGURATIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lioncub import methods

LION = "lion"  # the optimizer part of "<wrapper>+lion": plain Lion on every rank, the wrapper communicates


@dataclass(frozen=True)
class Wrapper:
    """What the model runs in. torch_ddp: torch's DistributedDataParallel, which all-reduces the fp32
    gradients during backward (or, with a LionCub method attached by lioncub.attach_ddp, sends nothing)."""

    name: str
    summary: str
    torch_ddp: bool = False
    fsdp: bool = False  # FSDP2 shards the model inside each node (HSDP); lioncub.apps.train.sharding


LIONCUB = Wrapper("lioncub", "the model as it is; LionCub does all the communication")
DDP = Wrapper("ddp", "the model in torch DDP (fp32 gradients all-reduced in backward)", torch_ddp=True)
HSDP = Wrapper("hsdp", "the model sharded by FSDP2 inside each node; across nodes FSDP's all-reduce (+lion) or "
                       "LionCub's method", fsdp=True)


@dataclass(frozen=True)
class Configuration:
    """A wrapper and an optimizer: LionCub with `method`, or plain Lion (method None)."""

    wrapper: Wrapper
    method: methods.Method | None

    @property
    def name(self) -> str:
        """What users type: the method's name alone for LionCub's own communication, else <wrapper>+<optimizer>."""
        optimizer = self.method.name if self.method is not None else LION
        return optimizer if self.wrapper is LIONCUB else f"{self.wrapper.name}+{optimizer}"

    @property
    def plain_lion(self) -> bool:
        """Plain Lion on every rank: the wrapper communicates, LionCub is not used (no dense warm-up, no stats)."""
        return self.method is None

    @property
    def dense(self) -> bool:
        """LionCub's dense method (Method.dense, methods.BASELINE): averaged gradients, no codec."""
        return self.method is not None and self.method.dense

    @property
    def compressed(self) -> bool:
        """A LionCub method with a codec: what momentum sync and the hierarchical layout apply to."""
        return self.method is not None and not self.method.dense

    @property
    def uses_levels(self) -> bool:
        """The method quantizes to L1 levels (l1-pbit): `levels` applies."""
        return self.method is not None and self.method.uses_levels


CONFIGURATIONS: tuple[Configuration, ...] = (
    *(Configuration(LIONCUB, m) for m in methods.REGISTRY.values()),
    Configuration(DDP, None),
    Configuration(HSDP, None),
    *(Configuration(HSDP, m) for m in methods.REGISTRY.values()),
)
BY_NAME: dict[str, Configuration] = {c.name: c for c in CONFIGURATIONS}
NAMES: tuple[str, ...] = tuple(BY_NAME)  # the methods, ddp+lion, hsdp+lion, hsdp+<method> (--method's choices)
DDP_LION = BY_NAME[f"{DDP.name}+{LION}"]  # the baseline users run today


def parse(text: str) -> Configuration:
    """The configuration `text` names; a one-line ValueError listing the choices for anything else."""
    try:
        return BY_NAME[text]
    except (KeyError, TypeError):
        raise ValueError(f"unknown method {text!r}; choose one of {', '.join(NAMES)}") from None


WARMUP = "+warmup:"  # a map cell's dense start: "vote-1bit+warmup:100" runs TrainConfig(dense_warmup=100)
# a cell's local steps: "vote-1bit+local:25" runs TrainConfig(local_steps=25), "vote-1bit+local:25:avg:1"
# also TrainConfig(outer="avg:1"); it ends the configuration's text
LOCAL = "+local:"


# streamed outer steps: "vote-1bit+local:25+stream:5" also runs TrainConfig(fragments=5), "+stream:5:4" also
# outer_delay=4; after the local steps
STREAM = "+stream:"


def split_stream(text: str) -> tuple[str, int | None, int | None]:
    """(the configuration without its +stream:F[:D], F or None, D or None)."""
    head, sep, rest = text.partition(STREAM)
    if not sep:
        return text, None, None
    f, _, d = rest.partition(":")
    if not f.isdigit() or int(f) < 1 or not (d == "" or d.isdigit()) or LOCAL not in head:
        raise ValueError(f"{text!r}: streamed outer steps are +local:H[:outer]+stream:F[:D] with F >= 1, D >= 0")
    return head, int(f), int(d) if d else None


def split_local(text: str) -> tuple[str, int | None, str | None]:
    """(the configuration without its local steps (and +stream:F), H or None, the outer optimizer or None)."""
    head, sep, rest = split_stream(text)[0].partition(LOCAL)
    if not sep:
        return text, None, None
    h, _, outer = rest.partition(":")
    if not h.isdigit() or int(h) < 1:
        raise ValueError(f"{text!r}: local steps are +local:H[:outer] with H >= 1")
    return head, int(h), outer or None


def split_run(text: str) -> tuple[str, str, int]:
    """A convergence-map cell's configuration, "<method>[@<momentum sync>][+warmup:<K>]", as (method, sync,
    dense warm-up steps): "vote-1bit@adaptive" -> ("vote-1bit", "adaptive", 0), "vote-1bit+warmup:100" ->
    ("vote-1bit", "none", 100). One-line ValueError for a bad K."""
    head, sep, k = split_local(text)[0].partition(WARMUP)
    warmup = 0
    if sep:
        if not k.isdigit() or int(k) < 1:
            raise ValueError(f"{text!r}: the dense warm-up is +warmup:K with K >= 1 steps")
        warmup = int(k)
    method, _, sync = head.partition("@")
    return method, sync or "none", warmup
