"""ResNet v1.5 (He et al. 2016; torchvision's variant: a Bottleneck strides on its 3x3 conv).

torchvision's module names: conv1, bn1, layer1.0.conv1, ..., layerK.i.downsample.0
(1x1 conv) / .1 (BN), fc. Parameter counts at 1000 classes: resnet18 11,689,512,
resnet34 21,797,672, resnet50 25,557,032, resnet101 44,549,160, resnet152 60,192,808.

A residual block computes  y = relu(main(x) + shortcut(x))  where shortcut is the
identity or `downsample` (1x1 conv with stride, then BN) when the shape changes.
The ReLUs after a BatchNorm are fused into it (BatchNorm2d(relu=True)); they have
no parameters, so torchvision's names are unchanged. The main branch's last BatchNorm
adds the shortcut and applies the block's ReLU in its own pass (its `residual`).
Backward: g = dy * [y > 0];  dx = main'(g) + shortcut'(g), the sum made by the main
branch's first convolution as it computes its dx (Conv2d.backward's add_to).

Gradient order. The arena lays parameters out in reverse registration order and
the trainer all-reduces a bucket as soon as backward has written it, so each
block's backward must write its gradients in exactly that order. `downsample`
is registered last (as in torchvision), so backward runs the shortcut branch
first, then the main branch from its last layer to its first.
"""
from mpitrain.kernels import elementwise

from .batchnorm import BatchNorm2d
from .conv import Conv2d
from .linear import Linear
from .module import Module, Sequential, check_backward, check_input
from .pool import GlobalAvgPool2d, MaxPool2d


class _Block(Module):
    """The residual arithmetic shared by both blocks; subclasses set `main` and `downsample`.

    main: the layers of the main branch in forward order (registered by the subclass).
    """

    downsample = None

    def forward(self, x, train=True):
        y = x
        for layer in self.main[:-1]:
            y = self.run_layer(layer, "forward", y, train)
        shortcut = (x if self.downsample is None else
                    self.run_layer(self.downsample, "forward", x, train))
        # the last BN adds the shortcut and clamps, in its one pass over the block's output
        y = self.run_layer(self.main[-1], "forward", y, train, residual=shortcut)
        self.y = y if train else None   # (N, H, W, C); its positive entries are the ReLU mask
        return y

    def backward(self, dy):
        y, self.y = self.y, None
        g = elementwise.relu_grad(dy, y)
        dshortcut = g if self.downsample is None else self.run_layer(self.downsample,
                                                                      "backward", g)
        for layer in reversed(self.main[1:]):
            g = self.run_layer(layer, "backward", g)
        # the first layer adds its dx into the shortcut's (read by now, if it is g itself)
        return self.run_layer(self.main[0], "backward", g, add_to=dshortcut)


class BasicBlock(_Block):
    """conv3x3(stride) - BN - ReLU - conv3x3 - BN, plus shortcut, then ReLU (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None, zero_init_residual=False):
        self.conv1 = Conv2d(inplanes, planes, 3, stride=stride, padding=1)
        self.bn1 = BatchNorm2d(planes, relu=True)
        self.conv2 = Conv2d(planes, planes, 3, padding=1)
        self.bn2 = BatchNorm2d(planes, zero_init=zero_init_residual)
        if downsample is not None:
            self.downsample = downsample
        self.main = [self.conv1, self.bn1, self.conv2, self.bn2]


class Bottleneck(_Block):
    """conv1x1 - BN - ReLU - conv3x3(stride) - BN - ReLU - conv1x1 (x4) - BN, plus shortcut,
    then ReLU (ResNet-50/101/152; v1.5 puts the stride on the 3x3 conv)."""

    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None, zero_init_residual=False):
        self.conv1 = Conv2d(inplanes, planes, 1)
        self.bn1 = BatchNorm2d(planes, relu=True)
        self.conv2 = Conv2d(planes, planes, 3, stride=stride, padding=1)
        self.bn2 = BatchNorm2d(planes, relu=True)
        self.conv3 = Conv2d(planes, planes * 4, 1)
        self.bn3 = BatchNorm2d(planes * 4, zero_init=zero_init_residual)
        if downsample is not None:
            self.downsample = downsample
        self.main = [self.conv1, self.bn1, self.conv2, self.bn2, self.conv3, self.bn3]


class ResNet(Module):
    """ResNet on NHWC input (N, H, W, 3); logits (N, num_classes).

    block: BasicBlock or Bottleneck; layers: blocks per stage; widths: planes per stage
    (the first stage strides 1, the others 2).
    small_stem: a 3x3 conv with stride `stem_stride` and no max-pool, for 32x32 images;
    otherwise torchvision's 7x7 stride-2 conv and 3x3 stride-2 max-pool.
    zero_init_residual: start the last BN gamma of every block at zero, so each block
    begins as the identity (Goyal et al. 2017).
    """

    def __init__(self, block, layers, num_classes=1000, widths=(64, 128, 256, 512),
                 small_stem=False, stem_stride=1, zero_init_residual=False):
        self.block, self.layers, self.widths = block, tuple(layers), tuple(widths)
        self.num_classes, self.small_stem, self.stem_stride = num_classes, small_stem, stem_stride
        self.inplanes = widths[0]
        # the images need no gradient: backward ends at conv1's weights
        if small_stem:
            self.conv1 = Conv2d(3, widths[0], 3, stride=stem_stride, padding=1, input_grad=False)
        else:
            self.conv1 = Conv2d(3, widths[0], 7, stride=2, padding=3, input_grad=False)
        self.bn1 = BatchNorm2d(widths[0], relu=True)
        sequence = [self.conv1, self.bn1]
        if not small_stem:
            self.maxpool = MaxPool2d(3, stride=2, padding=1)
            sequence.append(self.maxpool)
        for i, (planes, blocks) in enumerate(zip(widths, layers)):
            stage = self._make_stage(block, planes, blocks, 1 if i == 0 else 2, zero_init_residual)
            setattr(self, f"layer{i + 1}", stage)
            sequence.append(stage)
        self.avgpool = GlobalAvgPool2d()
        self.fc = Linear(widths[-1] * block.expansion, num_classes)
        self.sequence = sequence + [self.avgpool, self.fc]

    def _make_stage(self, block, planes, blocks, stride, zero_init_residual):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = Sequential(
                Conv2d(self.inplanes, planes * block.expansion, 1, stride=stride),
                BatchNorm2d(planes * block.expansion))
        stage = [block(self.inplanes, planes, stride, downsample, zero_init_residual)]
        self.inplanes = planes * block.expansion
        stage += [block(self.inplanes, planes, zero_init_residual=zero_init_residual)
                  for _ in range(1, blocks)]
        return Sequential(*stage)

    def forward(self, x, train=True):
        check_input(x, 3, self.dtype)
        self.backward_ready = train
        for layer in self.sequence:
            x = self.run_layer(layer, "forward", x, train)
        return x

    def backward(self, dy):
        check_backward(self)
        for layer in reversed(self.sequence):
            dy = self.run_layer(layer, "backward", dy)
        return dy


def resnet18(num_classes=1000, zero_init_residual=False):
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, zero_init_residual=zero_init_residual)


def resnet34(num_classes=1000, zero_init_residual=False):
    return ResNet(BasicBlock, (3, 4, 6, 3), num_classes, zero_init_residual=zero_init_residual)


def resnet50(num_classes=1000, zero_init_residual=False):
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, zero_init_residual=zero_init_residual)


def resnet101(num_classes=1000, zero_init_residual=False):
    return ResNet(Bottleneck, (3, 4, 23, 3), num_classes, zero_init_residual=zero_init_residual)


def resnet152(num_classes=1000, zero_init_residual=False):
    return ResNet(Bottleneck, (3, 8, 36, 3), num_classes, zero_init_residual=zero_init_residual)


def resnet_small(num_classes=10, zero_init_residual=False, layers=(1, 1, 1), widths=(16, 32, 64),
                 stem_stride=2):
    """A small ResNet for 32x32 images: a 3x3 stem conv, no max-pool, BasicBlock stages of
    widths 16/32/64; one block per stage by default (8 weight layers, 78,042 parameters
    at 10 classes).

    The stem strides 2 by default, so the stages run at 16x16, 8x8 and 4x4: a quarter
    of the work of CIFAR's stride-1 stem (3.1 M instead of 12.5 M multiply-adds per image),
    which keeps the default job (2 ranks on 2 cores) fast. The bundled digits are 8x8
    images upsampled to 32x32, so 16x16 loses nothing; pass stem_stride=1 for real
    32x32 images.
    """
    return ResNet(BasicBlock, layers, num_classes, widths=widths, small_stem=True,
                  stem_stride=stem_stride, zero_init_residual=zero_init_residual)
