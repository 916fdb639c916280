"""The models. Every step builds its model here, so weights move freely between steps.

`ResNet9` is the residual network of Page's "How to train your ResNet" (the DAWNBench CIFAR-10
winner; also the standard small, modern baseline): prep convolution, three stages, two residual
blocks, max-pool over the final 4x4 maps, one linear layer, logits scaled by 1/8. `width=32` halves
the original channels (64): 1.65M parameters instead of 6.57M, four times fewer FLOPs, so that a CPU
runs tens of steps in seconds and the tour stays quick to try, while the net keeps the original's
shape. Pass `width=64` for the full-size net on GPUs.

`VisionTransformer` is a small ViT for steps 09-11 (tensor parallelism splits linear layers, not convolutions):
4x4 patches (64 tokens), a learned position per patch, 6 pre-norm blocks of width 128 with 4 attention heads
and an MLP four times as wide, a linear head over all the tokens' features. 1.3M parameters, about the FLOPs of
ResNet9 at width 32. With `experts` (step 11), each block's MLP becomes a `MixtureOfExperts`.

`MnistCNN` is the small convolutional net of PyTorch's MNIST example, as the seed article uses it for
step 06: two 3x3 convolutions (32 and 64 channels), a max-pool, dropout, two linear layers.
"""

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

NORMS = ("batch", "group")
# ResNet9's top-level blocks in the order they run: the units that step 08 cuts into pipeline stages.
RESNET9_BLOCKS = ("prep", "layer1", "layer2", "layer3", "head")
# VisionTransformer's attention heads: step 09's tensor-parallel degree must divide them.
VIT_HEADS = 4
# Its tokens, the 4x4 patches of a 32x32 image: step 10's context-parallel degree must divide them.
VIT_TOKENS = (32 // 4) ** 2
# The original scales the logits by 1/8: max-pooled features are large, and unscaled logits make the
# first steps of SGD at a normal learning rate diverge.
LOGIT_SCALE = 0.125


def norm_layer(norm, channels):
    """BatchNorm normalises each channel over the batch that this process sees, so a distributed
    run (N smaller batches) computes a different function than one process with the whole batch.
    GroupNorm normalises over groups of channels of each sample alone: the same function at any
    world size, so that a distributed run can be checked against a single-process one (docs/parity.md)."""
    return nn.BatchNorm2d(channels) if norm == "batch" else nn.GroupNorm(8, channels)


def conv_norm_relu(in_channels, out_channels, norm):
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        norm_layer(norm, out_channels),
        nn.ReLU(inplace=True),
    )


class Residual(nn.Module):
    def __init__(self, channels, norm):
        super().__init__()
        self.body = nn.Sequential(conv_norm_relu(channels, channels, norm), conv_norm_relu(channels, channels, norm))

    def forward(self, x):
        return x + self.body(x)


class ResNet9(nn.Module):
    def __init__(self, num_classes=10, width=32, norm="batch"):
        super().__init__()
        self.prep = conv_norm_relu(3, width, norm)
        self.layer1 = nn.Sequential(conv_norm_relu(width, 2 * width, norm), nn.MaxPool2d(2), Residual(2 * width, norm))
        self.layer2 = nn.Sequential(conv_norm_relu(2 * width, 4 * width, norm), nn.MaxPool2d(2))
        self.layer3 = nn.Sequential(conv_norm_relu(4 * width, 8 * width, norm), nn.MaxPool2d(2),
                                    Residual(8 * width, norm))
        # MaxPool2d(4) over the 4x4 maps of a 32x32 image, as in the original: the same result as a global
        # AdaptiveMaxPool2d(1), whose backward pass on a GPU has no deterministic implementation.
        self.head = nn.Sequential(nn.MaxPool2d(4), nn.Flatten(), nn.Linear(8 * width, num_classes))

    def forward(self, x):
        return self.head(self.layer3(self.layer2(self.layer1(self.prep(x))))) * LOGIT_SCALE


class LogitScale(nn.Module):
    """ResNet9's last operation as a module, so that a pipeline stage can be a plain `nn.Sequential`."""

    def forward(self, x):
        return x * LOGIT_SCALE


def pipeline_stage(model, stage_index, stages):
    """The blocks of `model` (a ResNet9) that pipeline stage `stage_index` of `stages` runs, as an
    `nn.Sequential` whose parameters keep the names they have in ResNet9 (`layer3.0.0.weight`): the
    stages' state_dicts together are the whole model's. The blocks are shared with `model`, not copied.

    Consecutive blocks, as many per stage as possible alike, earlier stages taking one more: 2 stages
    cut after layer2. The last stage also scales the logits."""
    if not 1 <= stages <= len(RESNET9_BLOCKS):
        raise ValueError(f"ResNet9 has {len(RESNET9_BLOCKS)} blocks: it cuts into 1 to {len(RESNET9_BLOCKS)} stages")
    sizes = [len(RESNET9_BLOCKS) // stages + (index < len(RESNET9_BLOCKS) % stages) for index in range(stages)]
    first = sum(sizes[:stage_index])
    stage = nn.Sequential(OrderedDict((name, getattr(model, name))
                                      for name in RESNET9_BLOCKS[first:first + sizes[stage_index]]))
    if stage_index == stages - 1:
        stage.add_module("scale", LogitScale())
    return stage


class PatchEmbedding(nn.Module):
    """Each `patch` x `patch` square of the image becomes a token of `width` features (a convolution whose
    stride is its size projects each square alone), plus a learned vector for its position."""

    def __init__(self, width, patch, image_size=32, channels=3):
        super().__init__()
        self.projection = nn.Conv2d(channels, width, kernel_size=patch, stride=patch)
        self.position = nn.Parameter(torch.randn(1, (image_size // patch) ** 2, width) * 0.02)

    def forward(self, images):
        return self.projection(images).flatten(2).transpose(1, 2) + self.position  # (batch, tokens, width)


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.head_width = width // heads
        self.query, self.key, self.value = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.output = nn.Linear(width, width)

    def forward(self, x):
        # -1 heads: all of them, or the 1/T that this rank holds under tensor parallelism (step 09). Each of
        # q, k, v keeps its own number of tokens: under context parallelism (step 10) a rank's queries are
        # its own tokens, its keys and values every token of the image.
        q, k, v = (projection(x).unflatten(-1, (-1, self.head_width)).transpose(1, 2)
                   for projection in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v)  # (batch, heads, tokens, head_width)
        return self.output(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Experts(nn.Module):
    """`experts` MLPs without biases, their weights stacked: (experts, width, hidden) and (experts, hidden, width).
    Expert parallelism (step 11) splits them along their first dimension, a slice of the experts per rank."""

    def __init__(self, width, hidden, experts):
        super().__init__()
        self.up = nn.Parameter(torch.empty(experts, width, hidden))
        self.down = nn.Parameter(torch.empty(experts, hidden, width))
        for weights, fan_in in ((self.up, width), (self.down, hidden)):  # nn.Linear's initialisation, per expert
            nn.init.uniform_(weights, -fan_in ** -0.5, fan_in ** -0.5)

    def forward(self, tokens, counts):
        """Each expert's MLP on its tokens. `counts`: how many for each expert, in the order of `tokens`, which are
        sorted by expert; or, under expert parallelism (step 11), (ranks, experts): how many from each rank for
        each of this rank's experts, the tokens sorted by rank, then by expert."""
        # Split by expert (step 11), the weights are DTensors: this rank computes with its own experts.
        up, down = (w.to_local() if hasattr(w, "to_local") else w for w in (self.up, self.down))
        slices = tokens.split(counts.flatten().tolist())  # a wait on a GPU, unless the counts are on the CPU
        return torch.cat([F.gelu(x @ up[i % len(up)]) @ down[i % len(up)] for i, x in enumerate(slices)])


class MixtureOfExperts(nn.Module):
    """Step 11's MLP: `experts` MLPs, of which a router picks `top_k` for each token, their outputs weighed by
    the router's probabilities, renormalised over the chosen ones. Dropless: an expert takes every token routed
    to it, however many (no capacity), so the result does not depend on how the tokens are split across ranks.
    After each forward pass, `tokens_per_expert` holds the assignments it counted; `balance_loss` is the Switch
    Transformer's load-balancing loss."""

    def __init__(self, width, hidden, experts, top_k):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k {top_k} must be between 1 and the {experts} experts")
        self.top_k = top_k
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = Experts(width, hidden, experts)
        self.tokens_per_expert = self.mean_probabilities = None

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probabilities = self.router(tokens).softmax(dim=-1)
        weights, chosen = probabilities.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # The assignments, (token, expert) pairs, sorted by expert: each expert's tokens in one slice.
        experts = chosen.flatten()
        order = experts.argsort(stable=True)
        # Counted by adding ones: bincount would make the CPU wait for a GPU (it sizes its output by the largest).
        counts = torch.zeros(len(self.router.weight), dtype=torch.long, device=x.device).index_add(
            0, experts, torch.ones_like(experts))
        # index_select, not tokens[...]: its backward adds each token's top_k gradients in a fixed order (an
        # index's backward adds them with atomics on a CPU, not repeatable bit for bit at top_k > 2).
        outputs = self.experts(tokens.index_select(0, order // self.top_k), counts)
        combined = torch.zeros_like(tokens).index_add(0, order // self.top_k, outputs * weights.flatten()[order, None])
        self.tokens_per_expert, self.mean_probabilities = counts, probabilities.mean(dim=0)
        return combined.view_as(x)

    def balance_loss(self, counts=None):
        """experts x the sum over the experts of the fraction of the assignments that each got times its mean
        probability: 1 when the load is even, up to experts / top_k when top_k experts take every assignment.
        `counts`: the assignments counted over the whole batch (step 11 adds up every rank's); by default, the last
        forward's."""
        counts = self.tokens_per_expert if counts is None else counts
        return len(counts) * (counts / counts.sum() * self.mean_probabilities).sum()


class Block(nn.Module):
    """Pre-norm transformer block: x + dropout(attention(norm(x))), then the same with the MLP."""

    def __init__(self, width, heads, dropout, experts=0, top_k=1):
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(width), Attention(width, heads)
        # A mixture of experts (step 11): each with 1/top_k of the MLP's hidden features, so that a token
        # costs what it costs in the MLP (fine-grained experts, as DeepSeekMoE's).
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = MixtureOfExperts(width, 4 * width // top_k, experts, top_k) if experts else MLP(width, 4 * width)
        self.attention_dropout, self.mlp_dropout = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.attention_dropout(self.attention(self.attention_norm(x)))
        return x + self.mlp_dropout(self.mlp(self.mlp_norm(x)))


class VisionTransformer(nn.Module):
    def __init__(self, num_classes=10, width=128, depth=6, heads=VIT_HEADS, patch=4, dropout=True, experts=0,
                 top_k=1):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by {heads} heads")
        self.heads = heads
        self.embedding = PatchEmbedding(width, patch)
        # The same rate as the head of ViT's recipe for small data sets; dropout=False: see MnistCNN.
        self.blocks = nn.ModuleList(Block(width, heads, 0.1 if dropout else 0.0, experts, top_k) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        # A weight for every feature of every token, each place with its own, rather than one for their mean: a
        # synthetic image's class is which colour lies where.
        self.head = nn.Linear(self.embedding.position.shape[1] * width, num_classes)

    def forward(self, images):
        x = self.embedding(images)
        for block in self.blocks:
            x = block(x)
        # One row per image, (batch, tokens x width): its tokens' features one after another.
        return self.head(self.norm(x).flatten(1))


class MnistCNN(nn.Module):
    def __init__(self, num_classes=10, dropout=True):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3)  # 28x28 -> 26x26
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3)  # -> 24x24, max-pooled to 12x12
        # Each process draws its own dropout masks, for its share of the batch: a distributed run
        # drops other units than one process would. dropout=False makes the two comparable (docs/parity.md).
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)
        self.fc1 = nn.Linear(64 * 12 * 12, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.fc1(torch.flatten(self.dropout1(x), 1)))
        return self.fc2(self.dropout2(x))  # logits (the example's log_softmax is inside F.cross_entropy)


def build(args):
    """The model that a CIFAR-10 step's flags describe (common/flags.py): ResNet-9 (`--norm`, `--width`) or, for
    steps 09-11, the vision transformer (`--width`, `--no-dropout`; 11's `--experts`, `--top-k`)."""
    if args.model == "vit":
        return VisionTransformer(width=args.width, dropout=not args.no_dropout, experts=getattr(args, "experts", 0),
                                 top_k=getattr(args, "top_k", 1))
    return ResNet9(norm=args.norm, width=args.width)


def predict(model, images, flip=False):
    """The model's logits; with `flip`, the mean of the logits of the images and of their mirror images
    (test-time augmentation: training flips the images, so the mirror image is as good a view)."""
    logits = model(images)
    return (logits + model(images.flip(-1))) / 2 if flip else logits


def count_parameters(model):
    return sum(parameter.numel() for parameter in model.parameters())


def load_weights(path, model_class=ResNet9, **options):
    """A `model.pt` written by any step, loaded on the CPU into a fresh `model_class(**options)`
    (`ResNet9` for the CIFAR-10 steps 01-05, 07 and 08, with `norm="group"` if trained with --norm group;
    `MnistCNN` for step 06; `VisionTransformer` for steps 09 and 10, and with `experts=`, `top_k=` for 11)."""
    model = model_class(**options)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model
