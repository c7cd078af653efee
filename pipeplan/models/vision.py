"""The vision zoo: torchvision and timm classifiers as their users would bring them.

Each callable builds the library's own model at its real structure (random weights, seeded, no
download) with a small class count, and returns it as it is: the ``nn.Module``, a
``make_batch`` of seeded ``(B, 3, image, image)`` images with integer labels, and cross
entropy on the logits.  Nothing here adapts the model to pipeplan.  Dropout and drop-path are
off (torchvision's ``dropout`` and ``stochastic_depth_prob``, timm's ``drop_rate``; timm's
``drop_path_rate`` is 0 by default) so that a step is deterministic.

======================  =====================================  =================================
name                    model                                  what it exercises (issue 31)
======================  =====================================  =================================
``resnet18``            torchvision ``resnet18``               ReLU(inplace) opening a unit
``mobilenet_v3``        torchvision ``mobilenet_v3_small``     Hardswish(inplace), BatchNorm
``efficientnet``        torchvision ``efficientnet_b0``        SiLU(inplace), squeeze-excite
``densenet``            torchvision ``densenet121``            concatenating dense blocks
``regnet``              torchvision ``regnet_y_400mf``         ReLU(inplace), grouped convs
``convnext``            torchvision ``convnext_tiny``          ``layer_scale`` bare parameter
``vit``                 torchvision ``VisionTransformer``      ``class_token`` bare parameter
                        (ViT-Tiny widths, 4 layers)
``swin``                torchvision ``SwinTransformer``        relative position bias tables
                        (``swin_t``'s configuration)
``timm_resnetd``        timm ``resnet26d``                     deep stem, avg-pool downsample
``timm_vit``            timm ``vit_tiny_patch16_224``          ``is_causal=False``, ``cls_token``
``timm_deit``           timm ``deit_tiny_patch16_224``         the same, distilled-token family
``timm_convnext``       timm ``convnext_atto``                 ``gamma`` bare parameter
``timm_mixer``          timm ``mixer_s16_224``                 MLP-Mixer
``timm_mobilevit``      timm ``mobilevit_xxs``                 conv + transformer hybrid
======================  =====================================  =================================

``pipeplan.models.vision:NAME`` takes ``image`` (side, default 64), ``classes`` (default 10) and
``seed`` as ``--model-arg``s.  The transformers (ViT, DeiT, Swin, Mixer) are built for the
``image`` side given.

torchvision on a CPU-only torch: the only torchvision wheel served for torch 2.13 is the CUDA
build, whose C++ extension does not load against the CPU torch; :func:`import_torchvision`
defines the two op schemas its import needs first (:mod:`pipeplan.intake.torchvision_ops`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeplan.intake.model import ModelSpec
from pipeplan.intake.torchvision_ops import define_missing_ops
from pipeplan.models._common import build_seeded, generator, positive

__all__ = ["VISION", "build", "import_torchvision"]


def import_torchvision() -> ModuleType:
    """``torchvision``, importable on a CPU torch even from its CUDA wheel
    (:mod:`pipeplan.intake.torchvision_ops`)."""
    define_missing_ops()
    return importlib.import_module("torchvision")


def _tv(name: str, **kwargs: Any) -> Callable[[int, int], nn.Module]:
    def make(image: int, classes: int) -> nn.Module:
        models = import_torchvision().models
        if name == "VisionTransformer":  # the class itself: vit_b_16's 86 M are too many here
            return models.VisionTransformer(image_size=image, num_classes=classes, **kwargs)  # type: ignore[no-any-return]
        if name == "SwinTransformer":  # swin_t's own config, but swin_t fixes stochastic depth
            return models.SwinTransformer(num_classes=classes, **kwargs)  # type: ignore[no-any-return]
        return getattr(models, name)(weights=None, num_classes=classes, **kwargs)  # type: ignore[no-any-return]

    return make


def _timm(name: str, sized: bool = False, **kwargs: Any) -> Callable[[int, int], nn.Module]:
    def make(image: int, classes: int) -> nn.Module:
        import_torchvision()  # timm imports it
        import timm

        extra: dict[str, Any] = {"img_size": image} if sized else {}
        return timm.create_model(  # type: ignore[no-any-return]
            name, pretrained=False, num_classes=classes, drop_rate=0.0, **extra, **kwargs
        )

    return make


#: name -> builder of (image side, classes).
_TABLE: dict[str, Callable[[int, int], nn.Module]] = {
    "resnet18": _tv("resnet18"),
    "mobilenet_v3": _tv("mobilenet_v3_small", dropout=0.0),
    "efficientnet": _tv("efficientnet_b0", dropout=0.0, stochastic_depth_prob=0.0),
    "densenet": _tv("densenet121"),
    "regnet": _tv("regnet_y_400mf"),
    "convnext": _tv("convnext_tiny", stochastic_depth_prob=0.0),
    "vit": _tv(
        "VisionTransformer", patch_size=16, num_layers=4, num_heads=3, hidden_dim=192, mlp_dim=768
    ),
    "swin": _tv(
        "SwinTransformer",
        patch_size=[4, 4],
        embed_dim=96,
        depths=[2, 2, 6, 2],
        num_heads=[3, 6, 12, 24],
        window_size=[7, 7],
        stochastic_depth_prob=0.0,
    ),
    "timm_resnetd": _timm("resnet26d"),
    "timm_vit": _timm("vit_tiny_patch16_224", sized=True),
    "timm_deit": _timm("deit_tiny_patch16_224", sized=True),
    "timm_convnext": _timm("convnext_atto"),
    "timm_mixer": _timm("mixer_s16_224", sized=True),
    "timm_mobilevit": _timm("mobilevit_xxs"),
}


def build(name: str, image: int = 64, classes: int = 10, seed: int = 0) -> ModelSpec:
    """Vision zoo model ``name`` (random weights) with seeded image batches and cross entropy."""
    if name not in _TABLE:
        raise ValueError(f"vision model {name!r} is not one of {', '.join(_TABLE)}")
    positive(image=image, classes=classes, seed=seed + 1)
    model = build_seeded(seed, lambda: _TABLE[name](image, classes))

    def make_batch(b: int) -> tuple[Tensor, Tensor]:
        g = generator(seed, b)
        return torch.randn(b, 3, image, image, generator=g), torch.randint(
            classes, (b,), generator=g
        )

    return ModelSpec(model, make_batch, F.cross_entropy)


#: Every vision model: ``pipeplan.models.vision:NAME`` is ``build(NAME, ...)``.
VISION: dict[str, Callable[..., ModelSpec]] = {name: partial(build, name) for name in _TABLE}

for _name, _build in VISION.items():
    globals()[_name] = _build
__all__ += list(VISION)
