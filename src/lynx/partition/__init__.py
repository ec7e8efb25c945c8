"""Partitioners: one module per algorithm, one result type (`Partition`)."""

from lynx.partition.base import Partition, even_partition, explicit_partition
from lynx.partition.dp import dp_partition

__all__ = ["Partition", "dp_partition", "even_partition", "explicit_partition"]
