"""Data: the seam a run reads its samples through (:mod:`ddpexp.data.base`: the
:class:`DataSource` a ``data`` option is, in-memory datasets and their loader, the resumable
sampler, the three-way split) and the catalogue of sources the ``data`` config group names
(:mod:`ddpexp.data.sources`). ``ddpexp.data.<Name>``, as configs and saved runs name them,
resolves to either, importing only the module that defines it."""

from ddpexp import lazy_attributes

__getattr__, __dir__ = lazy_attributes(__name__, {
    "InMemory": "ddpexp.data.base",
    "ResumableDistributedSampler": "ddpexp.data.base",
    "TensorLoader": "ddpexp.data.base",
    "seed_worker": "ddpexp.data.base",
    "DataSource": "ddpexp.data.base",
    "split_indices": "ddpexp.data.base",
    "Digits": "ddpexp.data.sources",
    "Synthetic": "ddpexp.data.sources",
    "read_idx": "ddpexp.data.sources",
    "MNIST": "ddpexp.data.sources",
    "FashionMNIST": "ddpexp.data.sources",
    "CIFAR10": "ddpexp.data.sources",
    "ImageFolder": "ddpexp.data.sources",
    "Diabetes": "ddpexp.data.sources",
    "Text": "ddpexp.data.sources",
    "HF": "ddpexp.data.hf",
    "Shards": "ddpexp.data.shards",
})
