"""PyTorch twins of mpitrain's networks, to verify them (tests, `bench step --reference torch`).

Never imported by the training path. torchvision is not available here, so its
AlexNet and ResNet (v1.5) are written out below with torchvision's module names;
the state_dict keys are then exactly mpitrain's parameter and buffer names.

Layouts differ in two places, converted by mpitrain.tools.export (NumPy only, so that
`export` writes torchvision's layout without torch):
- convolution weights: mpitrain OHWI, torch OIHW  (torch = ours.transpose(0, 3, 1, 2));
- a linear layer after a flatten (AlexNet's classifier.1): mpitrain flattens NHWC in
  (H, W, C) order, torch NCHW in (C, H, W) order, so the weight's columns are permuted.
"""
import numpy as np
import torch
from torch import nn

from mpitrain.backend import to_numpy
from mpitrain.tools.export import flattened, from_torch_layout, torch_state_dict
from mpitrain.nets import alexnet as ours_alexnet
from mpitrain.nets import resnet as ours_resnet


class AlexNet(nn.Module):
    def __init__(self, num_classes=1000, batch_norm=False, dropout=0.5):
        super().__init__()
        layers, in_ch = [], 3
        for out_ch, k, s, p, pool in ours_alexnet.CONVS:
            layers.append(nn.Conv2d(in_ch, out_ch, k, stride=s, padding=p, bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out_ch))
            layers.append(nn.ReLU())
            if pool:
                layers.append(nn.MaxPool2d(3, stride=2))
            in_ch = out_ch
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(),
            nn.Dropout(dropout), nn.Linear(4096, 4096), nn.ReLU(),
            nn.Linear(4096, num_classes))

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU()
        self.downsample = downsample

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, block, layers, num_classes=1000, widths=(64, 128, 256, 512),
                 small_stem=False, stem_stride=1):
        super().__init__()
        self.inplanes = widths[0]
        if small_stem:
            self.conv1 = nn.Conv2d(3, widths[0], 3, stem_stride, 1, bias=False)
        else:
            self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        self.maxpool = nn.Identity() if small_stem else nn.MaxPool2d(3, 2, 1)
        for i, (planes, blocks) in enumerate(zip(widths, layers)):
            setattr(self, f"layer{i + 1}",
                    self._make_stage(block, planes, blocks, 1 if i == 0 else 2))
        self.stages = len(layers)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1] * block.expansion, num_classes)

    def _make_stage(self, block, planes, blocks, stride):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride, bias=False),
                nn.BatchNorm2d(planes * block.expansion))
        stage = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        stage += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*stage)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def twin(model):
    """An untrained torch network with the architecture of mpitrain network `model`."""
    if isinstance(model, ours_alexnet.AlexNet):
        return AlexNet(model.num_classes, model.batch_norm, model.dropout)
    if isinstance(model, ours_resnet.ResNet):
        block = Bottleneck if model.block is ours_resnet.Bottleneck else BasicBlock
        return ResNet(block, model.layers, model.num_classes, model.widths, model.small_stem,
                      model.stem_stride)
    raise TypeError(f"no torch twin for {type(model).__name__}")


def to_torch(model, dtype=torch.float32):
    """A torch twin of `model` holding its master weights and BN running statistics."""
    # skip torch's own initialisation: all is overwritten
    with torch.device("meta"):
        tmodel = twin(model).to(dtype)
    tmodel = tmodel.to_empty(device="cpu")
    state = {name: torch.from_numpy(a) for name, a in torch_state_dict(model).items()}
    tmodel.load_state_dict(state, strict=True)   # names the keys either side lacks
    return tmodel


def input_to_torch(x, dtype=torch.float32):
    """NHWC numpy batch -> NCHW torch tensor."""
    return torch.from_numpy(np.ascontiguousarray(to_numpy(x).transpose(0, 3, 1, 2))).to(dtype)


def grads_to_ours(model, tmodel):
    """name -> the torch gradient of each of `model`'s parameters, as numpy in mpitrain's layout."""
    tparams = dict(tmodel.named_parameters())
    flat = flattened(model)
    return {name: np.ascontiguousarray(from_torch_layout(tparams[name].grad.detach().numpy(),
                                                         flat.get(name)))
            for name, _ in model.named_params()}


def buffers_to_ours(tmodel):
    """name -> each BN running statistic of the torch twin, as numpy."""
    return {name: b.detach().numpy().copy() for name, b in tmodel.named_buffers()
            if not name.endswith("num_batches_tracked")}
