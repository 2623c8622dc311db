"""A method written the way README's "Adding a method" says: one module, registered as a module's line in
lioncub.methods._MODULES registers it. Its codec is vote-pbit's, so it must train exactly as vote-pbit does."""

from lioncub.comm import wire
from lioncub.methods.base import FieldMethod


class ToyVote(FieldMethod):
    name = "toy-vote"
    summary = "vote-pbit under another name (the test that a method is one module)"
    codec = wire.Codec("fields", values="vote", decode="sign")


METHOD = ToyVote()


def register() -> None:
    from lioncub import methods

    if METHOD.name not in methods.REGISTRY:
        methods.register(METHOD)


def train(rank, world_size, method):
    """Four steps on two ranks' different gradients; returns the flat parameters."""
    import torch

    register()
    from lioncub import LionCub

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    opt = LionCub(net.parameters(), lr=0.01, method=method, momentum_sync=2, bucket_mb=1e-4)
    for step in range(4):
        gen = torch.Generator().manual_seed(10 * step + rank)
        opt.zero_grad()
        net(torch.randn(3, 5, generator=gen)).square().sum().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])
