"""Keeps ddpexp's ``submitit_slurm`` defaults (``config.store_slurm_defaults``) in the
ConfigStore whatever the order of Hydra's plugin scan.

The scan executes every module under ``hydra_plugins`` again, in the order of the package's
path and, within one directory, of the names: in a plain install ``ddpexp_launcher`` comes
before ``hydra_submitit_launcher``, whose config module then stores submitit's own defaults
over ddpexp's. Hydra asks its search-path plugins for their paths after the scan and before
it composes, which is where the defaults are stored once more; the search path itself is
left as it is."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from hydra_plugins.ddpexp_launcher.config import store_slurm_defaults


class SlurmDefaults(SearchPathPlugin):
    """Stores ddpexp's ``submitit_slurm`` defaults as Hydra starts to compose."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        store_slurm_defaults()
