"""Federated data: raw sources, partitioners, natural-client files (LEAF, TFF, FedJAX) and their
cache, and the on-device `FederatedData`."""

from fedjax_pfl.data import partition
from fedjax_pfl.data.build import PartitionConfig, build_federated, partition_indices, plot_label_distribution
from fedjax_pfl.data.federated import ClientSplits, FederatedData, label_counts
from fedjax_pfl.data.formats import NATURAL_DATASETS, load_natural, open_reader, to_federated
from fedjax_pfl.data.natural import DataFormatError, NaturalClients, Task
from fedjax_pfl.data.partition import PARTITIONS, PartitionError
from fedjax_pfl.data.sources import DATASETS, DatasetNotFoundError, RawDataset, load_raw

__all__ = [
    "partition", "PartitionConfig", "build_federated", "partition_indices", "plot_label_distribution",
    "ClientSplits", "FederatedData", "label_counts", "PARTITIONS", "PartitionError", "DATASETS",
    "DatasetNotFoundError", "RawDataset", "load_raw", "DataFormatError", "NaturalClients", "Task",
    "NATURAL_DATASETS", "load_natural", "open_reader", "to_federated",
]
