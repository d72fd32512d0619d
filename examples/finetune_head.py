"""Fine-tuning in a swarm: a frozen base (every peer loads the same weights) and a small head
that trains. Only the head's parameters are exchanged, averaged and checkpointed; peers check
that their frozen bases agree. The lines geotrain adds are marked `# geotrain`.

    geotrain local -n 3 -- python finetune_head.py --steps 500
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.nn import functional as F

import geotrain  # geotrain


def pretrained_base() -> nn.Module:
    """Stands in for a downloaded backbone (e.g. torchvision's resnet18(weights=...)): every peer
    must load the same values."""
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = pretrained_base()
    base.requires_grad_(False)  # frozen before join: not exchanged (its digest is compared)
    torch.manual_seed(0)
    head = nn.Linear(128, 10)
    model = nn.Sequential(base, head)

    peer = int(os.environ.get("GEOTRAIN_LOCAL_INDEX", "0"))
    generator = torch.Generator().manual_seed(100 + peer)  # each peer its own examples
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))  # the labels' rule

    with geotrain.join(model) as swarm:  # geotrain
        opt = swarm.wrap(torch.optim.AdamW(head.parameters(), lr=3e-3))  # geotrain
        while swarm.step < args.steps:
            x = torch.randn(64, 32, generator=generator)
            loss = F.cross_entropy(model(x), (x @ teacher).argmax(1))
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()
        with torch.no_grad():
            x = torch.randn(1000, 32, generator=torch.Generator().manual_seed(9))
            accuracy = (model(x).argmax(1) == (x @ teacher).argmax(1)).float().mean().item()
        print(f"done: step {swarm.step} loss {loss.item():.3f} held-out accuracy {accuracy:.2f}")


if __name__ == "__main__":
    main()
