"""Persistent per-request state of the model runner, kept in numpy rows.

Each running request owns one row for its whole life in the executor. The scheduler
sends a request in full once (``NewRequestData``) and then only deltas, which are
applied here in place; nothing is rebuilt per step. Step tensors are gathered from
these rows with a handful of vectorized numpy operations (see ``prepare_step``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class StepIndices:
    """The flat token layout of one step, computed in bulk from the rows."""

    rows: np.ndarray  # int64 [R], batch order
    num_scheduled: np.ndarray  # int32 [R]
    query_start_loc: np.ndarray  # int32 [R + 1]
    positions: np.ndarray  # int64 [T]
    input_ids: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    seq_lens: np.ndarray  # int32 [R]
    block_tables: np.ndarray  # int32 [R, M]
    # Rows (batch indices) whose last scheduled token is the last known token: they sample.
    sample_batch_idx: np.ndarray  # int64 [S]
    logits_indices: np.ndarray  # int64 [S], flat token index whose hidden state samples
    max_query_len: int
    max_seq_len: int
    # KV cache groups 1.. of a hybrid model (group 0's are the two fields above): each
    # group's cache slots [T] and block tables [R, M]. Empty with one group.
    group_slot_mappings: tuple[np.ndarray, ...] = ()
    group_block_tables: tuple[np.ndarray, ...] = ()


class InputBatch:
    """Token ids, progress and block tables (one per KV cache group) of up to
    ``max_num_reqs`` requests."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 num_kv_cache_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_tables = np.zeros((num_kv_cache_groups, max_num_reqs, max_blocks),
                                     dtype=np.int32)
        self.block_table = self.block_tables[0]  # group 0 (the only one, mostly)
        self.num_blocks = np.zeros((num_kv_cache_groups, max_num_reqs), dtype=np.int64)
        # Each row's state slot (models with state layers; 0, the null slot, otherwise).
        self.state_slots = np.zeros(max_num_reqs, dtype=np.int32)
        # Each row's LoRA adapter id (0: the base model).
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_id_to_row: dict[str, int] = {}
        self.row_to_req_id: list[str | None] = [None] * max_num_reqs
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() gives row 0 first

    # -- request lifecycle -----------------------------------------------------------------
    def add(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        block_ids: tuple[list[int], ...],
        num_computed_tokens: int,
        state_slot: int | None = None,
        lora_id: int = 0,
    ) -> int:
        if req_id in self.req_id_to_row:
            raise ValueError(f"request {req_id!r} is already in the batch")
        if not self._free_rows:
            raise RuntimeError("input batch is full: the scheduler exceeded max_num_seqs")
        row = self._free_rows.pop()
        n_prompt, n_out = len(prompt_token_ids), len(output_token_ids)
        self.token_ids[row, :n_prompt] = prompt_token_ids
        self.token_ids[row, n_prompt : n_prompt + n_out] = output_token_ids
        self.num_prompt_tokens[row] = n_prompt
        self.num_tokens[row] = n_prompt + n_out
        self.num_computed_tokens[row] = num_computed_tokens
        self.state_slots[row] = state_slot or 0
        self.lora_ids[row] = lora_id
        self.num_blocks[:, row] = 0
        self.append_blocks(row, block_ids)
        self.req_id_to_row[req_id] = row
        self.row_to_req_id[row] = req_id
        return row

    def remove(self, req_id: str) -> int | None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is not None:
            self.row_to_req_id[row] = None
            self._free_rows.append(row)
        return row

    def append_blocks(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        """Append each KV cache group's new block ids to the row's table of that group."""
        if len(block_ids) != len(self.block_tables):
            raise ValueError(f"block ids for {len(block_ids)} KV cache groups, the batch "
                             f"has {len(self.block_tables)}")
        for group, ids in enumerate(block_ids):
            if ids:
                start = int(self.num_blocks[group, row])
                self.block_tables[group, row, start : start + len(ids)] = ids
                self.num_blocks[group, row] = start + len(ids)

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Record one sampled token per row (bulk)."""
        room = self.num_tokens[rows] < self.max_model_len
        rows, token_ids = rows[room], token_ids[room]
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def append_token_lists(self, rows: np.ndarray, token_ids: list[list[int]]) -> None:
        """Record several new tokens per row (accepted drafts and the step's own token)."""
        counts = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(rows))
        flat = np.fromiter(
            (t for tokens in token_ids for t in tokens), dtype=np.int64, count=int(counts.sum())
        )
        row_of = np.repeat(rows, counts)
        cols = np.repeat(self.num_tokens[rows], counts) + segment_offsets(counts)
        room = cols < self.max_model_len
        self.token_ids[row_of[room], cols[room]] = flat[room]
        self.num_tokens[rows] = np.minimum(self.num_tokens[rows] + counts, self.max_model_len)

    def write_scratch(self, rows: np.ndarray, starts: np.ndarray, token_ids: np.ndarray,
                      counts: np.ndarray) -> None:
        """Put tokens that are not known yet (drafts) at ``starts[i]..`` of each row,
        where a step's inputs are gathered from; ``num_tokens`` does not move."""
        row_of = np.repeat(rows, counts)
        cols = np.repeat(starts, counts) + segment_offsets(counts)
        self.token_ids[row_of, cols] = token_ids

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)

    # -- step preparation -----------------------------------------------------------------
    def prepare_step(self, rows: np.ndarray, num_scheduled: np.ndarray) -> StepIndices:
        """Flatten the scheduled requests into one token batch, all in numpy."""
        num_scheduled = num_scheduled.astype(np.int32)
        if bool((num_scheduled == 1).all()):  # one token per request: a decode step
            return self._decode_step(rows, num_scheduled)
        computed = self.num_computed_tokens[rows]
        seq_lens = (computed + num_scheduled).astype(np.int32)
        sample_batch_idx = np.flatnonzero(seq_lens >= self.num_tokens[rows])
        return self._span(rows, computed, num_scheduled, sample_batch_idx)

    def span(
        self,
        rows: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        input_ids: np.ndarray | None = None,
    ) -> StepIndices:
        """Positions ``[starts[i], starts[i] + counts[i])`` of each row as one batch whose
        every row yields logits at its last token (a draft model's pass). ``input_ids``
        (flat) replaces the tokens gathered from the rows."""
        counts = np.asarray(counts, dtype=np.int32)
        step = self._span(rows, np.asarray(starts, dtype=np.int64), counts,
                          np.arange(len(rows), dtype=np.int64))
        if input_ids is not None:
            step.input_ids = np.asarray(input_ids, dtype=np.int64)
        return step

    def _span(
        self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
        sample_batch_idx: np.ndarray,
    ) -> StepIndices:
        """The flat layout of ``counts[i]`` tokens from position ``starts[i]`` per row."""
        cu = np.cumsum(counts, dtype=np.int64)
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
        query_start_loc[1:] = cu
        token_row = np.repeat(rows, counts)
        positions = np.repeat(starts, counts) + segment_offsets(counts)
        seq_lens = (starts + counts).astype(np.int32)
        return self._step_indices(
            rows, counts, query_start_loc, token_row, positions, seq_lens,
            sample_batch_idx, logits_indices=cu[sample_batch_idx] - 1,
        )

    def as_decode_rows(self, step: StepIndices) -> StepIndices:
        """The same tokens with each one its own attention row: token ``t`` at position
        ``p`` attends to its request's first ``p + 1`` cache slots, which is exactly causal
        attention within the request (every token's K/V is written before any attention
        reads). A few tokens per request (drafts being verified) then run as a decode
        step: the decode kernel, and a forward graph of that many rows."""
        token_row = np.repeat(step.rows, step.num_scheduled)
        n = len(token_row)
        seq_lens = (step.positions + 1).astype(np.int32)
        width = step.block_tables.shape[1]
        return StepIndices(
            rows=token_row,
            num_scheduled=np.ones(n, dtype=np.int32),
            query_start_loc=np.arange(n + 1, dtype=np.int32),
            positions=step.positions,
            input_ids=step.input_ids,
            slot_mapping=step.slot_mapping,
            seq_lens=seq_lens,
            block_tables=self.block_table[token_row, :width],
            sample_batch_idx=step.sample_batch_idx,
            logits_indices=step.logits_indices,
            max_query_len=1,
            max_seq_len=step.max_seq_len,
            group_slot_mappings=step.group_slot_mappings,
            group_block_tables=tuple(table[token_row, :width]
                                     for table in self.block_tables[1:]),
        )

    def _decode_step(self, rows: np.ndarray, num_scheduled: np.ndarray) -> StepIndices:
        """``prepare_step`` when every request has exactly one new token: token ``i`` is
        request ``i``, so the flattening arithmetic drops out."""
        positions = self.num_computed_tokens[rows]
        seq_lens = (positions + 1).astype(np.int32)
        sample_batch_idx = np.flatnonzero(seq_lens >= self.num_tokens[rows])
        return self._step_indices(
            rows, num_scheduled, np.arange(len(rows) + 1, dtype=np.int32), rows, positions,
            seq_lens, sample_batch_idx, logits_indices=sample_batch_idx,
        )

    def _step_indices(
        self,
        rows: np.ndarray,
        num_scheduled: np.ndarray,
        query_start_loc: np.ndarray,
        token_row: np.ndarray,
        positions: np.ndarray,
        seq_lens: np.ndarray,
        sample_batch_idx: np.ndarray,
        logits_indices: np.ndarray,
    ) -> StepIndices:
        """The gathers both layouts share: token ids, cache slots, block tables."""
        bs = self.block_size
        block_index, offset = positions // bs, positions % bs
        max_seq_len = int(seq_lens.max())
        width = -(-max_seq_len // bs)
        slots = [table[token_row, block_index].astype(np.int64) * bs + offset
                 for table in self.block_tables]
        return StepIndices(
            rows=rows,
            num_scheduled=num_scheduled,
            query_start_loc=query_start_loc,
            positions=positions,
            input_ids=self.token_ids[token_row, positions],
            slot_mapping=slots[0],
            seq_lens=seq_lens,
            block_tables=self.block_table[rows, :width],
            sample_batch_idx=sample_batch_idx,
            logits_indices=logits_indices.astype(np.int64, copy=False),
            max_query_len=int(num_scheduled.max()),
            max_seq_len=max_seq_len,
            group_slot_mappings=tuple(slots[1:]),
            group_block_tables=tuple(table[rows, :width] for table in self.block_tables[1:]),
        )


def dummy_step(num_groups: int = 1) -> StepIndices:
    """One token (id 0, position 0) of one request whose only block, in every KV cache
    group, is the null block 0; nothing samples."""
    zero = np.zeros(1, dtype=np.int64)
    table = np.zeros((1, 1), dtype=np.int32)
    return StepIndices(
        rows=zero, num_scheduled=np.ones(1, dtype=np.int32),
        query_start_loc=np.array([0, 1], dtype=np.int32), positions=zero.copy(),
        input_ids=zero.copy(), slot_mapping=zero.copy(), seq_lens=np.ones(1, dtype=np.int32),
        block_tables=table, sample_batch_idx=np.zeros(0, dtype=np.int64),
        logits_indices=np.zeros(0, dtype=np.int64), max_query_len=1, max_seq_len=1,
        group_slot_mappings=tuple(zero.copy() for _ in range(num_groups - 1)),
        group_block_tables=tuple(table.copy() for _ in range(num_groups - 1)),
    )


def segment_offsets(counts: np.ndarray) -> np.ndarray:
    """``0..counts[i]-1`` for each i, concatenated."""
    total = int(counts.sum())
    starts = np.cumsum(counts, dtype=np.int64) - counts
    return np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
