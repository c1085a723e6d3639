"""Paged KV caches in Python: the pages of a block table an entry uses, the check that they lie
in the pool, the pages gathered into packed or dense rows, and the slots of new rows.

A pool is (pages, page_size, H_kv, D) (or with fewer trailing dims: an 8-bit cache's scales);
block_table (N, max_pages) integer: page c of entry b is the pool's page block_table[b, c]; entry
b's keys are the first lengths[b] rows of its pages, in table order. The kernels read pools of
pages of a multiple of 64 rows in place; these serve the other cases: functional.varlen_attn
(other page sizes), flash_attn (its dropout fallback, its cache appends).
"""

from __future__ import annotations

import torch
from torch import Tensor


def pages_of(lengths: Tensor, page: int) -> Tensor:
    """int64 (N,): the pages entry b's first lengths[b] keys fill, ceil(lengths[b] / page)."""
    return (lengths.to(torch.int64) + page - 1) // page


def used(block_table: Tensor, n_pages: Tensor) -> Tensor:
    """bool (N, columns): whether column c of block_table's row b is one of entry b's n_pages[b]."""
    return torch.arange(block_table.size(1)).view(1, -1) < n_pages.view(-1, 1)


def check_in_pool(fn: str, block_table: Tensor, n_pages: Tensor, pool: int, pool_name: str) -> None:
    """Every page the entries use (their first n_pages[b] columns) is one of the pool's."""
    outside = (block_table < 0) | (block_table >= pool)
    if bool((outside & used(block_table, n_pages)).any()):
        raise ValueError(f"{fn}: block_table holds a page outside {pool_name}'s {pool} pages")


def gather_packed(pool: Tensor, block_table: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """The pool read through block_table as packed rows (T, ...) and their int32 offsets (N + 1,):
    each entry's first ceil(lengths[b] / page_size) pages, in table order (checked by the caller)."""
    page = pool.size(1)
    n_pages = pages_of(lengths, page)
    pages = block_table.to(torch.int64)[used(block_table, n_pages)]
    rows = pool.index_select(0, pages).reshape(-1, *pool.shape[2:])
    cu = torch.zeros(block_table.size(0) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(n_pages * page, 0)
    return rows, cu


def gather_dense(pool: Tensor, block_table: Tensor, lengths: Tensor) -> Tensor:
    """The pool read through block_table as a dense (N, n * page_size, ...) copy, n the pages of the
    longest entry (at least 1, at most the table's columns): the pages holding each entry's first
    lengths[b] keys (columns past them read page 0; the caller masks their keys)."""
    page = pool.size(1)
    n = max(1, (int(lengths.max()) + page - 1) // page) if lengths.numel() else 1
    table = block_table[:, : min(n, block_table.size(1))]
    pages = torch.where(used(table, pages_of(lengths, page)), table.to(torch.int64), 0)
    return pool.index_select(0, pages.flatten()).view(table.size(0), table.size(1) * page, *pool.shape[2:])


def slots(block_table: Tensor, positions: Tensor, page: int) -> Tensor:
    """int64, positions' shape: the pool slot (page * page_size + row) of position positions[b, t]
    of entry b, where new rows are written (functional.write_kv_cache)."""
    return block_table.to(torch.int64).gather(1, positions // page) * page + positions % page
