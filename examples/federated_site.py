"""A federated-style site: its data never leaves it; only models do, after training with
differential privacy (Opacus: per-sample clipping and noise, its accountant), and neighbours'
models are mixed with self-centred clipping (gossip.robust = "clip"), so one bad site cannot drag
the others far. Training stops when the site's privacy budget is spent. The lines geotrain adds
are marked `# geotrain`.

    pip install opacus
    geotrain local -n 3 -- python federated_site.py --epsilon 8
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
from opacus import PrivacyEngine
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import geotrain  # geotrain


def site_data(site: int, n: int = 2000) -> TensorDataset:
    """This site's own examples: the same task everywhere, each site's inputs shifted (non-IID)."""
    g = torch.Generator().manual_seed(site)
    x = torch.randn(n, 20, generator=g) + 0.5 * site
    w = torch.randn(20, generator=torch.Generator().manual_seed(42))
    return TensorDataset(x, (x @ w > 0.5 * site * w.sum()).long())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epsilon", type=float, default=8.0, help="this site's privacy budget")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--max-steps", type=int, default=0, help="stop earlier (0: the budget)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="opacus")  # (its notes on secure RNG and hooks)
    warnings.filterwarnings("ignore", message="Full backward hook")
    site = int(os.environ.get("GEOTRAIN_LOCAL_INDEX", "0"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 2))
    loader = DataLoader(site_data(site), batch_size=64, shuffle=True)

    with geotrain.join(model, gossip={"robust": "clip"}) as swarm:  # geotrain
        engine = PrivacyEngine(accountant="rdp")
        private, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
        opt = swarm.wrap(optimizer)  # geotrain: the private optimizer takes part in the swarm
        spent = 0.0
        while spent < args.epsilon and not (args.max_steps and swarm.step >= args.max_steps):
            for x, y in loader:
                loss = F.cross_entropy(private(x), y)
                loss.backward()
                opt.step(loss=loss)
                opt.zero_grad()
                spent = engine.get_epsilon(args.delta)
                if spent >= args.epsilon or (args.max_steps and swarm.step >= args.max_steps):
                    break
        print(f"done: step {swarm.step} epsilon spent {spent:.2f} of {args.epsilon}")


if __name__ == "__main__":
    main()
