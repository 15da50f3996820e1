"""AlexNet (Krizhevsky et al. 2012, torchvision's single-tower layout) and AlexNet-BN.

torchvision's layout, with its module names (`features.0.weight`,
`classifier.6.bias`):

    features    conv 11x11/4 p2 64, ReLU, max-pool 3/2,
                conv 5x5 p2 192, ReLU, max-pool 3/2,
                conv 3x3 p1 384, ReLU, conv 3x3 p1 256, ReLU, conv 3x3 p1 256, ReLU, max-pool 3/2
    avgpool     adaptive average pool to 6x6 (the identity at 224x224 input)
    flatten     (N, 6, 6, 256) -> (N, 9216) in (H, W, C) order
    classifier  Dropout, Linear 9216->4096, ReLU, Dropout, Linear 4096->4096, ReLU,
                Linear 4096->classes

61,100,840 parameters at 1000 classes.

AlexNet-BN (Jia et al. 2018 train "AlexNet-BN") puts a BatchNorm2d after every
convolution, before its ReLU. The convolutions lose their bias, which BN's beta
replaces: 5 conv biases (1,152 values) go, 5 BNs (2 x 1,152 values) come, so
61,101,992 parameters at 1000 classes. Its feature indices shift accordingly
(conv, BN, ReLU[, pool] per stage: features.0, .4, .8, .11, .14 are the convolutions),
as in torchvision's vgg*_bn.
"""
from .activation import Dropout, ReLU
from .batchnorm import BatchNorm2d
from .conv import Conv2d
from .linear import Flatten, Linear
from .module import Module, Sequential, check_backward, check_input
from .pool import AdaptiveAvgPool2d, MaxPool2d

# (out_channels, kernel, stride, padding, max-pool after) of the five convolutions
CONVS = [(64, 11, 4, 2, True), (192, 5, 1, 2, True), (384, 3, 1, 1, False),
         (256, 3, 1, 1, False), (256, 3, 1, 1, True)]


class AlexNet(Module):
    """AlexNet on NHWC input (N, H, W, 3); logits (N, num_classes).

    dropout: the drop probability of both classifier dropouts (0 makes them the identity).
    seed, rank: the two dropout layers' masks are drawn from generators seeded by
    (seed, rank, 0) and (seed, rank, 1): each rank of a run draws its own.
    """

    def __init__(self, num_classes=1000, batch_norm=False, dropout=0.5, seed=0, rank=0):
        self.num_classes = num_classes
        self.batch_norm = batch_norm
        self.dropout = dropout
        layers, in_ch = [], 3
        for out_ch, k, s, p, pool in CONVS:
            # the images need no gradient: backward ends at the first convolution's weights
            layers.append(Conv2d(in_ch, out_ch, k, stride=s, padding=p, bias=not batch_norm,
                                 input_grad=bool(layers)))
            if batch_norm:
                layers.append(BatchNorm2d(out_ch))
            layers.append(ReLU())
            if pool:
                layers.append(MaxPool2d(3, stride=2))
            in_ch = out_ch
        self.features = Sequential(*layers)
        self.avgpool = AdaptiveAvgPool2d((6, 6))
        self.flatten = Flatten()
        self.classifier = Sequential(
            Dropout(dropout, seed=(seed, rank, 0)), Linear(256 * 6 * 6, 4096), ReLU(),
            Dropout(dropout, seed=(seed, rank, 1)), Linear(4096, 4096), ReLU(),
            Linear(4096, num_classes))
        self.stages = [self.features, self.avgpool, self.flatten, self.classifier]

    def forward(self, x, train=True):
        check_input(x, 3, self.dtype)
        self.backward_ready = train
        for stage in self.stages:
            x = self.run_layer(stage, "forward", x, train)
        return x

    def backward(self, dy):
        check_backward(self)
        # reverse registration order: the arena's order, so buckets complete in sequence
        for stage in reversed(self.stages):
            dy = self.run_layer(stage, "backward", dy)
        return dy


def alexnet(num_classes=1000, dropout=0.5, seed=0, rank=0):
    return AlexNet(num_classes, batch_norm=False, dropout=dropout, seed=seed, rank=rank)


def alexnet_bn(num_classes=1000, dropout=0.5, seed=0, rank=0):
    return AlexNet(num_classes, batch_norm=True, dropout=dropout, seed=seed, rank=rank)
