"""A site: the N ranks of a torchrun job (DDP or FSDP inside) as one member of the swarm."""

from ._share import REPLICATED as REPLICATED
from ._share import SHARDED as SHARDED
from ._share import SiteTrainer as SiteTrainer
from ._share import share_views as share_views
from ._share import site_module as site_module
from ._site import Site as Site
from ._site import SiteBroken as SiteBroken
from ._site import lane_config as lane_config
from ._site import open_site as open_site
from ._site import site_world as site_world
