"""Loaded at interpreter start-up by a ``tune run`` launcher that a test runs with this folder on PYTHONPATH.

With ``SLOW_RENDEZVOUS_CLOSE_S`` set, this launcher closes torchrun's c10d rendezvous that many seconds late, as a
node that is slower to leave (a loaded machine): the launcher hosting the rendezvous store would otherwise exit
first, and this one's requests met a closed connection (a C++ stack dump; issue 40 item 11). The variable is
removed at once, so the workers this launcher starts do not import torch's rendezvous for nothing.
"""

import os

_DELAY = os.environ.pop("SLOW_RENDEZVOUS_CLOSE_S", None)

if _DELAY:
    import time

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    _shutdown = dynamic_rendezvous.DynamicRendezvousHandler.shutdown

    def _late_shutdown(handler):
        time.sleep(float(_DELAY))
        return _shutdown(handler)

    dynamic_rendezvous.DynamicRendezvousHandler.shutdown = _late_shutdown
