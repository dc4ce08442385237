"""``LLMDataDist``: lifetime, links and roles of one instance (see ``_node``)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from hixl.compat.llm_datadist._config import DataDistOptions, parse_listen, parse_options
from hixl.compat.llm_datadist._manager import CacheManager
from hixl.compat.llm_datadist._node import Node
from hixl.compat.llm_datadist._status import (
    LLMStatusCode,
    check_int,
    check_type,
    code_of,
    refuse,
    require,
)
from hixl.compat.llm_datadist._types import U64, LLMClusterInfo, LLMRole, ip_text
from hixl.errors import HixlError

__all__ = ["LLMDataDist"]

log = logging.getLogger("hixl.compat.llm_datadist")

MAX_CLUSTERS_PER_CALL = 16  # CANN: link_clusters/unlink_clusters take at most 16 clusters
_I32_MAX = 2**31 - 1


class LLMDataDist:
    """One KV-cache endpoint: ``init`` it, link peers, move caches, ``finalize`` it.

    Several instances may live in one process (CANN allows one; tests use more).
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_type("role", role, LLMRole)
        self._role = role
        self._cluster_id = check_int("cluster_id", cluster_id, 0, U64)
        self._node: Node | None = None
        self._manager: CacheManager | None = None
        self._opts: DataDistOptions | None = None

    def __repr__(self) -> str:
        state = "uninitialized" if self._node is None else f"links={len(self._node.links)}"
        return f"<LLMDataDist role={self._role.name} cluster_id={self._cluster_id} {state}>"

    def __del__(self) -> None:
        if getattr(self, "_node", None) is not None:
            warnings.warn(
                f"{self!r} collected without finalize(); finalizing now",
                ResourceWarning,
                stacklevel=2,
            )
            with contextlib.suppress(Exception):
                self.finalize()

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def role(self) -> LLMRole:
        return self._role

    @property
    def options(self) -> DataDistOptions | None:
        """The options as ``init`` understood them (hixl.compat only), None before ``init``."""
        return self._opts

    # -- lifetime ------------------------------------------------------------------------
    def init(self, options: Mapping[str, str]) -> None:
        """Open the engines: listen at ``llm.listenIpInfo`` when given.

        A second call does nothing.  Raises ``TypeError`` for a non-string option,
        :class:`LLMException` with ``LLM_PARAM_INVALID`` for a bad value or an address
        that cannot be bound, ``LLM_FAILED`` when no verbs device is usable.
        """
        if self._node is not None:
            return
        opts = parse_options(options, self._role)
        for note in opts.notes:
            log.info("init: %s", note)
        for key in opts.unknown:
            log.warning("init: unknown option %r ignored", key)
        if opts.device_id is not None:
            log.info("init: device_id %d accepted; caches are host memory here", opts.device_id)
        try:
            node = Node(self._cluster_id, opts)
        except HixlError as exc:
            refuse(code_of(exc), f"[LLMDataDist.init] failed: {exc}")
        self._node, self._opts = node, opts
        self._manager = CacheManager(node) if opts.cache_manager else None
        log.info("init %s success, cluster_id=%d", self._role.name, self._cluster_id)

    def finalize(self) -> None:
        """Close every link and engine; registrations go.  Safe to call twice; ``init``
        may be called again afterwards (the listening address is free at once)."""
        node, self._node, self._manager = self._node, None, None
        if node is not None:
            node.close()

    def _require(self) -> Node:
        node = self._node
        if node is None:
            raise RuntimeError("llm datadist is not initialized")
        return node

    @property
    def cache_manager(self) -> CacheManager:
        """The :class:`CacheManager`; needs the cache manager mode (``enable_cache_manager``
        or ``local_comm_res``), as in CANN."""
        self._require()
        manager = self._manager
        if manager is None:
            refuse(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                "cache_manager is not supported when llm.EnableCacheManager is not configured "
                "(set LLMConfig.enable_cache_manager = True or local_comm_res); the older "
                "KvCacheManager mode is not provided here",
            )
        return manager

    @property
    def kv_cache_manager(self) -> CacheManager:
        """Not supported: the older KvCacheManager mode (use ``cache_manager``)."""
        refuse(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            "kv_cache_manager (the mode without llm.EnableCacheManager) is not provided here; "
            "enable the cache manager and use cache_manager",
        )

    # -- links ---------------------------------------------------------------------------
    @staticmethod
    def _check_clusters(clusters: object, timeout: object) -> list[LLMClusterInfo]:
        check_int("timeout", timeout, -(2**31), _I32_MAX)
        assert isinstance(timeout, int)
        require(timeout > 0, "Param timeout should be greater than 0.")
        check_type("clusters", clusters, list, tuple)
        assert isinstance(clusters, list | tuple)
        for cluster in clusters:
            check_type("clusters element", cluster, LLMClusterInfo)
            check_int("remote_cluster_id", cluster.remote_cluster_id, 0, U64)
        return list(clusters)

    def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to each cluster's listener (``append_remote_ip_info``); ``timeout`` in ms.

        Returns ``(status, [status per cluster])``: ``LLM_SUCCESS``, ``LLM_ALREADY_LINK``,
        ``LLM_LINK_FAILED`` (nothing answers, or the peer refuses), ``LLM_TIMEOUT``,
        ``LLM_PARAM_INVALID`` (not exactly one remote address);
        ``LLM_CLUSTER_NUM_EXCEED_LIMIT`` for more than 16 clusters.  The links are made
        in parallel; the first status is the last failure, or ``LLM_SUCCESS``.
        """
        node = self._require()
        items = self._check_clusters(clusters, timeout)
        assert self._opts is not None
        if len(items) > MAX_CLUSTERS_PER_CALL:
            code = LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
            return code, [code] * len(items)
        require(len(items) > 0, "clusters size must > 0")
        for cluster in items:
            require(
                bool(cluster.local_ip_info_list) or bool(node.opts.local_comm_res),
                "local_ip_info_list is empty. Call append_local_ip_info to add local_ip_info "
                "when local_comm_res option is unspecified or empty.",
            )

        def one(cluster: LLMClusterInfo) -> LLMStatusCode:
            if len(cluster.remote_ip_info_list) != 1:
                log.warning(
                    "link_clusters: cluster %s needs exactly one remote ip info, got %d",
                    cluster.remote_cluster_id,
                    len(cluster.remote_ip_info_list),
                )
                return LLMStatusCode.LLM_PARAM_INVALID
            ip, port = cluster.remote_ip_info_list[0]
            if port == 0:
                return LLMStatusCode.LLM_PARAM_INVALID
            assert cluster.remote_cluster_id is not None
            return node.link(cluster.remote_cluster_id, f"{ip_text(ip)}:{port}", timeout / 1000)

        with ThreadPoolExecutor(
            max_workers=len(items), thread_name_prefix="hixl-llmdd-link"
        ) as pool:
            codes = list(pool.map(one, items))
        failed = [c for c in codes if c != LLMStatusCode.LLM_SUCCESS]
        return (failed[-1] if failed else LLMStatusCode.LLM_SUCCESS), codes

    def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Close the links this instance made to ``clusters`` (the peers see them go).

        A cluster this side never linked to gives ``LLM_SUCCESS`` (nothing to do), as in
        CANN's hixl backend; ``force`` changes nothing here (both ends' resources of a
        link go when either end closes it).
        """
        node = self._require()
        items = self._check_clusters(clusters, timeout)
        check_type("force", force, bool)
        if len(items) > MAX_CLUSTERS_PER_CALL:
            code = LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
            return code, [code] * len(items)
        require(len(items) > 0, "clusters size must > 0")
        codes = []
        for cluster in items:
            assert cluster.remote_cluster_id is not None
            codes.append(node.unlink(cluster.remote_cluster_id))
        failed = [c for c in codes if c != LLMStatusCode.LLM_SUCCESS]
        return (failed[-1] if failed else LLMStatusCode.LLM_SUCCESS), codes

    def switch_role(self, role: LLMRole, switch_options: Mapping[str, str] | None = None) -> None:
        """Take ``role``; with ``llm.listenIpInfo`` in ``switch_options`` listen there
        (closing a listener elsewhere), without it stop listening (a client only).

        Raises ``LLM_EXIST_LINK`` while this side still has links (unlink first).  With
        the hixl transfer backend the listener never changes (a different address gives
        ``LLM_FEATURE_NOT_ENABLED``), as in CANN.
        """
        node = self._require()
        check_type("role", role, LLMRole)
        check_type("switch_options", switch_options, dict, allow_none=True)
        options = dict(switch_options or {})
        for key, value in options.items():
            check_type("switch_options key", key, str)
            check_type(f"switch_options {key}", value, str)
        links = node.links
        require(
            not links,
            f"switch_role: links to clusters {sorted(links)} remain; unlink_clusters first",
            LLMStatusCode.LLM_EXIST_LINK,
        )
        text = options.get("llm.listenIpInfo")
        listen = parse_listen(text) if text else None
        log.info("[switch_role] [%s->%s] start, listen=%s", self._role.name, role.name, listen)
        if node.opts.hixl_backend:
            require(
                listen is None or listen == node.listen,
                f"listen ip info {text} is not the same as the one given to init "
                f"({node.listen}): the hixl backend cannot change its listener",
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        elif listen is None:
            node.close_server()
        elif listen != node.listen:
            node.open_server(listen)
        self._role = role
        log.info("[switch_role] success, role=%s", role.name)

    # -- not in scope --------------------------------------------------------------------
    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """Not supported: HCCL ranktable links (use ``link_clusters``)."""
        refuse(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            "link() builds an HCCL communication domain from a ranktable, which needs Ascend "
            "NPUs; use link_clusters (one-sided links over ip:port)",
        )

    def unlink(self, comm_id: int) -> None:
        """Not supported: HCCL ranktable links (use ``unlink_clusters``)."""
        refuse(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            "unlink() closes an HCCL communication domain, which needs Ascend NPUs; use "
            "unlink_clusters",
        )

    def query_register_mem_status(self, comm_id: int) -> object:
        """Not supported: it reports on an HCCL link made by ``link``."""
        refuse(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            "query_register_mem_status reports on an HCCL link made by link(), which is not "
            "supported here",
        )

    def check_link_status(self, remote_cluster_id: int) -> None:
        """Not supported: the older KvCacheManager mode."""
        refuse(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            "check_link_status belongs to the KvCacheManager mode, which is not provided here",
        )
