"""Tensor parallelism for convolutional networks: filters split over ranks, and the classic
"data parallel for the convolutions, tensor parallel for the fully connected layers" split.

    conv = ColumnParallelConv2d.from_dense(dense_conv)     # rank r runs its share of the filters
    y = conv(x)                                             # [B, C_out, H, W] again on every rank

    model = HybridParallelCNN.from_dense(SmallCNN(...))     # convs replicated, FC layers split
    logits = model(shard(x))                                # this rank's B/p images -> [B, classes]
    F.cross_entropy(logits, y).backward()                   # y: the whole batch's labels
    model.sync_conv_grads()                                 # sum the conv gradients over the ranks

A convolution's filters are independent: with N filters on k ranks each rank runs N/k of them
on the whole input and gets N/k channels of the output; concatenating them on the channel
dimension gives the whole feature map. That is a column-parallel layer whose "columns" are
output channels: f (identity forward, all-reduce backward) on the input, an all-gather on dim 1.

In a CNN the convolutions do ~90-95% of the computation with ~5% of the parameters and big
activations, and the fully connected layers the opposite. So split the *batch* for the
convolutions (small gradients to synchronise) and the *weights* for the FC layers (no big
gradient all-reduce), switching layout once in between: the ranks' image features
[B/p, F] are all-gathered into [B, F] (reduce-scattered backward: that is exactly the
sequence-parallel entry of ColumnParallelLinear, with the batch in the role of the sequence),
then column -> ReLU -> row, whose all-reduce leaves the logits of the whole batch on every rank.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import comm
from ..data_parallel import shard
from .layers import (ColumnParallelLinear, RowParallelLinear, copy_to_parallel,
                              gather_from_parallel, my_range)


class ColumnParallelConv2d(nn.Module):
    """nn.Conv2d with its output filters split (uneven counts too): x [B, C_in, H, W] the same on
    every rank -> [B, C_out, H', W'] (gather_output=True) or this rank's channels [B, C_r, H', W']."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True,
                 gather_output=True, group=None):
        super().__init__()
        p = comm.world_size(group)
        if out_channels < p:
            raise ValueError(f"{out_channels} filters cannot be split over {p} ranks: each needs at least one")
        self.out_channels, self.stride, self.padding = out_channels, stride, padding
        self.gather_output, self.group = gather_output, group
        start, end = my_range(out_channels, group)
        dense = nn.Conv2d(in_channels, end - start, kernel_size, stride, padding, bias=bias)
        self.weight, self.bias = dense.weight, dense.bias           # this rank's filters only

    @classmethod
    def from_dense(cls, conv: nn.Conv2d, gather_output=True, group=None):
        m = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                conv.bias is not None, gather_output, group).to(conv.weight.dtype)
        start, end = my_range(conv.out_channels, group)
        with torch.no_grad():
            m.weight.copy_(conv.weight[start:end])
            if conv.bias is not None:
                m.bias.copy_(conv.bias[start:end])
        return m

    def forward(self, x):
        y = F.conv2d(copy_to_parallel(x, self.group), self.weight, self.bias, self.stride, self.padding)
        return gather_from_parallel(y, 1, self.group, self.out_channels) if self.gather_output else y


class SmallCNN(nn.Module):
    """conv-ReLU-pool x 2, then two fully connected layers. Images [B, C, size, size]."""

    def __init__(self, channels=3, size=8, classes=10, width=8, hidden=64):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        self.fc1, self.fc2 = nn.Linear(2 * width * (size // 4) ** 2, hidden), nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(self.features(x))))


class HybridParallelCNN(nn.Module):
    """SmallCNN with data-parallel convolutions and tensor-parallel FC layers (see the top)."""

    def __init__(self, cnn: SmallCNN, group=None):
        super().__init__()
        self.group = group
        self.features = copy.deepcopy(cnn.features)                  # replicated: data parallel
        self.fc1 = ColumnParallelLinear.from_dense(cnn.fc1, sequence_parallel=True, group=group)
        self.fc2 = RowParallelLinear.from_dense(cnn.fc2, group=group)

    @classmethod
    def from_dense(cls, cnn: SmallCNN, group=None):
        return cls(cnn, group)

    def shard(self, batch):
        """This rank's equal share of a global batch (the convolutions' data-parallel input)."""
        return shard(batch, comm.rank(self.group), comm.world_size(self.group))

    def forward(self, x_shard):
        h = self.features(x_shard)                 # [B/p, F]: my images' features
        h = F.relu(self.fc1(h))                    # all-gather over the batch -> [B, hidden/p]
        return self.fc2(h)                         # all-reduce -> [B, classes] on every rank

    def sync_conv_grads(self):
        """Each rank's conv gradients hold its own images' share of the whole batch's loss: sum
        them (one all-reduce of a flat buffer). The FC gradients are already complete."""
        grads = [p.grad for p in self.features.parameters() if p.grad is not None]
        if comm.world_size(self.group) == 1 or not grads:
            return
        flat = torch.cat([g.flatten() for g in grads])
        comm.all_reduce(flat, group=self.group)
        for g, new in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(new.view_as(g))
