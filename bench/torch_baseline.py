"""The ingest baseline: a plain ``torch.utils.data.DataLoader`` over the same parquet
shards, doing the same transforms (raylora's own ``Preprocess``: validating decode, resize,
crop, flip, tokenize) in the same number of worker processes.

Its own module so spawned DataLoader workers can import it.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, get_worker_info


class ParquetShards(IterableDataset):
    """Worker w reads files w, w+W, ... row group by row group, 32 rows a batch (the batch
    size raylora's Preprocess stage gets from Ray Data), and yields single samples."""

    def __init__(self, files: list[str], uri: str, pre_kwargs: dict, rows_per_call: int = 32):
        self.files, self.uri, self.pre_kwargs, self.rows_per_call = files, uri, pre_kwargs, rows_per_call
        self._pre = None

    def _stage(self):
        if self._pre is None:  # once per worker process, like the Ray actor's __init__
            from raylora.data.preprocess import Preprocess, StageSpec

            self._pre = Preprocess(StageSpec(**self.pre_kwargs))
        return self._pre

    def __iter__(self):
        import numpy as np

        from raylora.storage import Storage, fs_path

        info = get_worker_info()
        wid, workers = (info.id, info.num_workers) if info else (0, 1)
        fs, _ = Storage().fs(self.uri)
        pre = self._stage()
        for f in self.files[wid::workers]:
            with fs.open_input_file(fs_path(f)) as fh:
                pf = pq.ParquetFile(fh)
                for rb in pf.iter_batches(batch_size=self.rows_per_call, columns=["image", "text"]):
                    out = pre({"image": np.array(rb.column("image").to_pylist(), dtype=object),
                               "text": np.array(rb.column("text").to_pylist())})
                    for i in range(len(out["input_ids"])):
                        yield {k: torch.from_numpy(v[i]) for k, v in out.items()
                               if k in ("pixel_values", "input_ids")}
