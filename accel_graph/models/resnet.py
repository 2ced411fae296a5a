"""A small ResNet (BasicBlock, resnet18-shaped, narrower) for the convnet rows of the benchmark.

Bundled so ``accel-graph bench --models`` needs no download and no torchvision. The topology is
resnet18's (a strided 7x7 stem and a max-pool, four stages of two BasicBlocks each, the first
block of stages 2-4 downsampling with a strided 3x3 and a 1x1 projection, global average pool,
linear head); the widths and the input size are smaller so that a CPU run takes seconds per
variant, not minutes. Weights and batch-norm statistics come from a fixed seed through a local
``torch.Generator`` (the global RNG is never touched), so two builds with the same
:class:`ResNetConfig` are bitwise identical. The model is built in ``eval()`` mode: batch norm
reads its running statistics, so a forward pass has no side effects and can be replayed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

__all__ = ["ResNet", "ResNetConfig"]


@dataclass(frozen=True)
class ResNetConfig:
    """Sizes of the bundled ResNet. ``widths`` are the channels of the four stages (resnet18:
    64, 128, 256, 512), ``blocks`` the BasicBlocks per stage (resnet18: 2, 2, 2, 2)."""

    widths: tuple[int, ...] = (16, 32, 64, 128)
    blocks: tuple[int, ...] = (2, 2, 2, 2)
    in_channels: int = 3
    image_size: int = 64
    num_classes: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.widths or len(self.widths) != len(self.blocks):
            raise ValueError(
                f"widths {self.widths} and blocks {self.blocks} must be non-empty and of one length"
            )
        for name, values in (("widths", self.widths), ("blocks", self.blocks)):
            if any(v < 1 for v in values):
                raise ValueError(f"{name} must be positive, got {values}")
        for name in ("in_channels", "image_size", "num_classes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


class BasicBlock(nn.Module):
    """Two 3x3 conv + batch-norm layers and a residual connection (projected when the shape
    changes), as in resnet18."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        skip = x if self.down is None else self.down(x)
        return torch.relu(out + skip)


class ResNet(nn.Module):
    """The bundled ResNet: ``forward(x)`` maps ``[B, in_channels, H, W]`` float32 images to
    ``[B, num_classes]`` logits. Built in eval mode (see the module docstring)."""

    def __init__(self, config: ResNetConfig | None = None) -> None:
        super().__init__()
        cfg = config or ResNetConfig()
        self.config = cfg
        w0 = cfg.widths[0]
        self.stem = nn.Sequential(
            nn.Conv2d(cfg.in_channels, w0, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(w0),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        cin = w0
        for i, (width, n) in enumerate(zip(cfg.widths, cfg.blocks, strict=True)):
            layers = [BasicBlock(cin, width, 1 if i == 0 else 2)]
            layers += [BasicBlock(width, width, 1) for _ in range(n - 1)]
            stages.append(nn.Sequential(*layers))
            cin = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, cfg.num_classes)
        self._init_weights(cfg.seed)
        self.eval()

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Kaiming-normal convs, small linear head, and batch norm with non-trivial affine
        parameters and running statistics (so batch norm is not an identity a compiler could
        fold away by accident), all drawn from one local generator."""
        gen = torch.Generator().manual_seed(seed)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu", generator=gen)
            elif isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(1.0 + 0.1 * torch.randn(c, generator=gen))
                m.bias.copy_(0.1 * torch.randn(c, generator=gen))
                m.running_mean.copy_(0.1 * torch.randn(c, generator=gen))
                m.running_var.copy_(1.0 + 0.1 * torch.rand(c, generator=gen))
            elif isinstance(m, nn.Linear):
                m.weight.copy_(0.01 * torch.randn(m.weight.shape, generator=gen))
                m.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(x.mean((2, 3)), 1))

    def example_input(self, batch: int, seed: int = 1) -> Tensor:
        """A deterministic ``[batch, in_channels, image_size, image_size]`` input (local generator)."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        cfg = self.config
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(batch, cfg.in_channels, cfg.image_size, cfg.image_size, generator=gen)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
