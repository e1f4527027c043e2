"""Platform layer: device type, collective backend, streams/events, and every collective.

Nothing else in hyper_parallel calls ``torch.distributed`` collectives directly.
"""
from .comm import (CommHandle, CommRecord, CommTimeoutError, all_gather, all_gather_object,
                   all_reduce, all_to_all, all_to_all_uneven, barrier, comm_counter, default_timeout, group_rank,
                   group_size, launch_chain, pending_handles, reduce_scatter, set_default_timeout,
                   drain_chain_thread, forget_pending_handles)
from .peer import (CollectiveError, PeerFailure, PeerLostError, PeerTimeoutError, classify_failure,
                   diagnose)
from .device import Platform, PlatformError, detect_device_type, get_platform
from .process_group import (destroy_distributed, free_port, init_distributed, on_release,
                            release_subgroups)
from .streams import comm_stream, new_event, record_stream, stream_context

__all__ = [n for n in dir() if not n.startswith("_")]
