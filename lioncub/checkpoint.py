"""lioncub.checkpoint: checkpoints of a model and its LionCub optimizer, on torch.distributed.checkpoint.

    from lioncub.checkpoint import load, save          # or: lioncub.checkpoint.save(...)
    save(f"ckpt/{step}", model, opt, extra={"step": step})   # every rank calls it
    info = load(f"ckpt/{step}", model, opt)                  # every rank; info["extra"] is what was saved

The module's code is lioncub.integrations.checkpoint (the layer that drives LionCub from other code); this is its
public name, a real module so that `import lioncub.checkpoint` and `from lioncub.checkpoint import save` work.
"""

from lioncub.integrations.checkpoint import WAIT_S, CheckpointError, UnsafeCheckpointError, load, load_dcp, save

__all__ = ["WAIT_S", "CheckpointError", "UnsafeCheckpointError", "load", "load_dcp", "save"]
