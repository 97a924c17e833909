"""Datasets and partitioners."""

from edgefl.data.datasets import DATASET_NAMES, Dataset, download_idx, load_dataset, locate_idx_folder
from edgefl.data.held import DataSpec, HeldData, load_held_data
from edgefl.data.idx import read_idx, write_idx
from edgefl.data.partition import class_counts, contiguous, dirichlet, iid, shards, subsample

__all__ = [
    "DATASET_NAMES", "DataSpec", "Dataset", "HeldData", "class_counts", "dirichlet", "download_idx", "iid", "load_dataset",
    "contiguous", "load_held_data", "locate_idx_folder", "read_idx", "shards", "subsample", "write_idx",
]
