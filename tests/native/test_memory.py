"""Weights gathered into one buffer on 2 MiB pages."""
from __future__ import annotations

import torch
from torch import nn

from splice.native.memory import gather_on_huge_pages


def test_gathering_on_huge_pages_keeps_values_identity_and_ties():
    embed = nn.Embedding(64, 32).to(torch.bfloat16)
    head = nn.Linear(32, 64, bias=False).to(torch.bfloat16)
    head.weight = embed.weight  # tied
    other = nn.Linear(32, 48).to(torch.bfloat16)
    before = {name: p.detach().clone() for name, p in (("embed", embed.weight), ("other", other.weight))}
    ids = (id(embed.weight), id(other.weight))
    moved = gather_on_huge_pages([head.weight, other.weight, embed.weight])
    assert (id(embed.weight), id(other.weight)) == ids and head.weight is embed.weight
    assert torch.equal(embed.weight, before["embed"]) and torch.equal(other.weight, before["other"])
    if moved:  # huge pages available: one buffer, each weight 64-byte aligned
        assert moved == (64 * 32 + 48 * 32) * 2
        assert embed.weight.untyped_storage().data_ptr() == other.weight.untyped_storage().data_ptr()
        assert embed.weight.data_ptr() % 64 == 0 and other.weight.data_ptr() % 64 == 0


def test_gathering_groups_by_dtype_and_keeps_buffers_registered():
    layer = nn.Module()
    layer.register_buffer("qweight", torch.randint(-127, 128, (64, 96), dtype=torch.int8))
    layer.register_buffer("packed", torch.randint(0, 1 << 20, (4, 12, 16), dtype=torch.int32))
    before = {name: b.clone() for name, b in layer.named_buffers()}
    moved = gather_on_huge_pages(list(layer.buffers()))
    for name, buffer in layer.named_buffers():
        assert torch.equal(buffer, before[name]) and buffer is getattr(layer, name)
    assert moved in (0, 64 * 96 + 4 * 12 * 16 * 4)


def test_views_are_left_where_they_are():
    """A view keeps its base alive: moving the view's storage would leave the base's memory behind, doubling it."""
    base = torch.zeros(4, 1, 1 << 16, dtype=torch.int8)
    view = base.reshape(4, 1 << 16)
    pointer = view.data_ptr()
    assert gather_on_huge_pages([view]) == 0 and view.data_ptr() == pointer


def test_zeros_on_huge_pages_start_on_a_huge_page_where_they_span_one():
    from splice import native
    from splice.native.memory import zeros_on_huge_pages

    big = zeros_on_huge_pages((3, 2, 1 << 18), torch.bfloat16)  # 3 MiB
    small = zeros_on_huge_pages((4, 8), torch.float32)
    assert big.shape == (3, 2, 1 << 18) and big.dtype == torch.bfloat16 and big.is_contiguous()
    assert not big.any() and small.shape == (4, 8) and not small.any()
    if native.huge_pages_supported():
        assert big.data_ptr() % native.HUGE_PAGE == 0
    big[2, 1, -1] = 1  # its memory is its own: the last element is writable and read back
    assert big.sum().item() == 1
