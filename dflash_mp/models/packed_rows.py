"""Rows that pack several documents (data.packing): where each document starts, its positions.

A packed row is described by `document_ids` [B, S] int64: the record id of the document at each
position, -1 on the right padding. A document is a maximal run of equal ids (a record appears at
most once per epoch, so two neighbours never share an id); positions restart at 0 at each run.
Pure tensor ops on the ids' device: no host synchronisation.
"""

from __future__ import annotations

import torch
from torch import Tensor


def document_starts(document_ids: Tensor) -> Tensor:
    """[B, S] bool: True where a document (or the padding run) begins."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def document_index(document_ids: Tensor) -> Tensor:
    """[B, S] int64: 0 for the row's first document, 1 for the next, ... (padding counts as one)."""
    return document_starts(document_ids).long().cumsum(-1) - 1


def start_of_document(document_ids: Tensor) -> Tensor:
    """[B, S] int64: the row index where the document holding each position begins."""
    seq_len = document_ids.shape[1]
    positions = torch.arange(seq_len, device=document_ids.device).expand_as(document_ids)
    marks = torch.where(document_starts(document_ids), positions, 0)
    return marks.cummax(-1).values


def document_positions(document_ids: Tensor) -> Tensor:
    """[B, S] int64: each token's position within its own document (0 at every document start)."""
    seq_len = document_ids.shape[1]
    positions = torch.arange(seq_len, device=document_ids.device).expand_as(document_ids)
    return positions - start_of_document(document_ids)


def single_document_ids(sample_ids: Tensor, lengths: Tensor, seq_len: int) -> Tensor:
    """The document ids of unpacked rows: row b is record sample_ids[b] up to lengths[b], then -1."""
    positions = torch.arange(seq_len, device=sample_ids.device)
    real = positions[None, :] < lengths[:, None].to(sample_ids.device)
    return torch.where(real, sample_ids[:, None].long(), -1)
