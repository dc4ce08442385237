"""cffi declarations of the libibverbs ABI hixl uses, and the loaded library.

ABI mode: nothing is compiled.  The declarations below restate the layouts of
``<infiniband/verbs.h>`` (rdma-core, x86_64/aarch64 LP64) and ``lib()`` opens the
system's ``libibverbs.so.1`` with ``dlopen``.  A unit test compiles a C program
against the real header and checks every size and field offset declared here
(``tests/unit/test_verbs_ffi.py``), so a layout error cannot pass unnoticed.

Layout invariants (why the declarations look as they do):

* ``struct ibv_send_wr`` is 128 bytes only with all its unions declared,
  including the trailing anonymous ``bind_mw``/``tso`` one.
* ``ibv_post_send``, ``ibv_post_recv`` and ``ibv_poll_cq`` are ``static inline``
  in ``verbs.h``: they call through ``context->ops``, so all 32 slots of
  ``struct ibv_context_ops`` are declared in order (``poll_cq`` sits at
  context + 96, ``post_send`` at + 208).  The four slots hixl calls are declared
  ``void *`` and cast to their function types (``POLL_CQ`` ... ``POST_RECV``)
  once per queue: cffi's prebuilt type tables (below) abort on a struct member
  of function-pointer type.
* ``pthread_mutex_t``/``pthread_cond_t`` (inside ``ibv_cq``/``ibv_qp``) are
  glibc's 40 and 48 bytes; C enums are ``int``; big-endian typedefs are plain
  unsigned integers of the same width.
* The exported ``ibv_query_port`` is the compat entry point that fills
  ``struct ibv_port_attr`` up to ``link_layer``; the memory handed to it is the
  full, zeroed struct.

cffi releases the GIL around every call it makes, including calls through
function pointers read from a struct, so a long ``post_send`` (rxe runs the
transfer inside it) never stops other Python threads.

Start-up: parsing the declarations (pycparser) is most of what importing the verbs
layer costs, about 0.1 s natively and many seconds in an emulated VM, paid by every
process.  So the parsed types are kept in :mod:`hixl.verbs._ffi_tables`, generated
from ``CDEF`` by ``make ffi`` (cffi's out-of-line ABI mode: a Python file, nothing
compiled), and loaded from there.  A unit test checks that those tables describe
exactly ``CDEF``; where the installed cffi cannot read them, ``CDEF`` is parsed as
before.

This module is private: :mod:`hixl.verbs.adapter` and :mod:`hixl.verbs.chain` use it.
"""

from __future__ import annotations

import threading
from typing import Any

import cffi

CDEF = r"""
typedef union { char __size[40]; long __align; } pthread_mutex_t;
typedef union { char __size[48]; long long __align; } pthread_cond_t;

struct ibv_device;
struct ibv_srq;
struct ibv_ah;
struct ibv_mw;
struct ibv_context;
struct ibv_cq;
struct ibv_qp;
struct ibv_pd;
struct ibv_wc;
struct ibv_send_wr;
struct ibv_recv_wr;

struct ibv_context_ops {
    void *_compat_query_device;
    void *_compat_query_port;
    void *_compat_alloc_pd;
    void *_compat_dealloc_pd;
    void *_compat_reg_mr;
    void *_compat_rereg_mr;
    void *_compat_dereg_mr;
    void *alloc_mw;
    void *bind_mw;
    void *dealloc_mw;
    void *_compat_create_cq;
    void *poll_cq;
    void *req_notify_cq;
    void *_compat_cq_event;
    void *_compat_resize_cq;
    void *_compat_destroy_cq;
    void *_compat_create_srq;
    void *_compat_modify_srq;
    void *_compat_query_srq;
    void *_compat_destroy_srq;
    void *post_srq_recv;
    void *_compat_create_qp;
    void *_compat_query_qp;
    void *_compat_modify_qp;
    void *_compat_destroy_qp;
    void *post_send;
    void *post_recv;
    void *_compat_create_ah;
    void *_compat_destroy_ah;
    void *_compat_attach_mcast;
    void *_compat_detach_mcast;
    void *_compat_async_event;
};

struct ibv_context {
    struct ibv_device *device;
    struct ibv_context_ops ops;
    int cmd_fd;
    int async_fd;
    int num_comp_vectors;
    pthread_mutex_t mutex;
    void *abi_compat;
};

struct ibv_device_attr {
    char fw_ver[64];
    uint64_t node_guid;
    uint64_t sys_image_guid;
    uint64_t max_mr_size;
    uint64_t page_size_cap;
    uint32_t vendor_id;
    uint32_t vendor_part_id;
    uint32_t hw_ver;
    int max_qp;
    int max_qp_wr;
    unsigned int device_cap_flags;
    int max_sge;
    int max_sge_rd;
    int max_cq;
    int max_cqe;
    int max_mr;
    int max_pd;
    int max_qp_rd_atom;
    int max_ee_rd_atom;
    int max_res_rd_atom;
    int max_qp_init_rd_atom;
    int max_ee_init_rd_atom;
    int atomic_cap;
    int max_ee;
    int max_rdd;
    int max_mw;
    int max_raw_ipv6_qp;
    int max_raw_ethy_qp;
    int max_mcast_grp;
    int max_mcast_qp_attach;
    int max_total_mcast_qp_attach;
    int max_ah;
    int max_fmr;
    int max_map_per_fmr;
    int max_srq;
    int max_srq_wr;
    int max_srq_sge;
    uint16_t max_pkeys;
    uint8_t local_ca_ack_delay;
    uint8_t phys_port_cnt;
};

struct ibv_port_attr {
    int state;
    int max_mtu;
    int active_mtu;
    int gid_tbl_len;
    uint32_t port_cap_flags;
    uint32_t max_msg_sz;
    uint32_t bad_pkey_cntr;
    uint32_t qkey_viol_cntr;
    uint16_t pkey_tbl_len;
    uint16_t lid;
    uint16_t sm_lid;
    uint8_t lmc;
    uint8_t max_vl_num;
    uint8_t sm_sl;
    uint8_t subnet_timeout;
    uint8_t init_type_reply;
    uint8_t active_width;
    uint8_t active_speed;
    uint8_t phys_state;
    uint8_t link_layer;
    uint8_t flags;
    uint16_t port_cap_flags2;
};

union ibv_gid {
    uint8_t raw[16];
    struct {
        uint64_t subnet_prefix;
        uint64_t interface_id;
    } global;
};

struct ibv_gid_entry {
    union ibv_gid gid;
    uint32_t gid_index;
    uint32_t port_num;
    uint32_t gid_type;
    uint32_t ndev_ifindex;
};

struct ibv_pd {
    struct ibv_context *context;
    uint32_t handle;
};

struct ibv_mr {
    struct ibv_context *context;
    struct ibv_pd *pd;
    void *addr;
    size_t length;
    uint32_t handle;
    uint32_t lkey;
    uint32_t rkey;
};

struct ibv_comp_channel {
    struct ibv_context *context;
    int fd;
    int refcnt;
};

struct ibv_cq {
    struct ibv_context *context;
    struct ibv_comp_channel *channel;
    void *cq_context;
    uint32_t handle;
    int cqe;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t comp_events_completed;
    uint32_t async_events_completed;
};

struct ibv_qp {
    struct ibv_context *context;
    void *qp_context;
    struct ibv_pd *pd;
    struct ibv_cq *send_cq;
    struct ibv_cq *recv_cq;
    struct ibv_srq *srq;
    uint32_t handle;
    uint32_t qp_num;
    int state;
    int qp_type;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t events_completed;
};

struct ibv_qp_cap {
    uint32_t max_send_wr;
    uint32_t max_recv_wr;
    uint32_t max_send_sge;
    uint32_t max_recv_sge;
    uint32_t max_inline_data;
};

struct ibv_qp_init_attr {
    void *qp_context;
    struct ibv_cq *send_cq;
    struct ibv_cq *recv_cq;
    struct ibv_srq *srq;
    struct ibv_qp_cap cap;
    int qp_type;
    int sq_sig_all;
};

struct ibv_global_route {
    union ibv_gid dgid;
    uint32_t flow_label;
    uint8_t sgid_index;
    uint8_t hop_limit;
    uint8_t traffic_class;
};

struct ibv_ah_attr {
    struct ibv_global_route grh;
    uint16_t dlid;
    uint8_t sl;
    uint8_t src_path_bits;
    uint8_t static_rate;
    uint8_t is_global;
    uint8_t port_num;
};

struct ibv_qp_attr {
    int qp_state;
    int cur_qp_state;
    int path_mtu;
    int path_mig_state;
    uint32_t qkey;
    uint32_t rq_psn;
    uint32_t sq_psn;
    uint32_t dest_qp_num;
    unsigned int qp_access_flags;
    struct ibv_qp_cap cap;
    struct ibv_ah_attr ah_attr;
    struct ibv_ah_attr alt_ah_attr;
    uint16_t pkey_index;
    uint16_t alt_pkey_index;
    uint8_t en_sqd_async_notify;
    uint8_t sq_draining;
    uint8_t max_rd_atomic;
    uint8_t max_dest_rd_atomic;
    uint8_t min_rnr_timer;
    uint8_t port_num;
    uint8_t timeout;
    uint8_t retry_cnt;
    uint8_t rnr_retry;
    uint8_t alt_port_num;
    uint8_t alt_timeout;
    uint32_t rate_limit;
};

struct ibv_sge {
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
};

struct ibv_mw_bind_info {
    struct ibv_mr *mr;
    uint64_t addr;
    uint64_t length;
    unsigned int mw_access_flags;
};

struct ibv_send_wr {
    uint64_t wr_id;
    struct ibv_send_wr *next;
    struct ibv_sge *sg_list;
    int num_sge;
    int opcode;
    unsigned int send_flags;
    union {
        uint32_t imm_data;
        uint32_t invalidate_rkey;
    };
    union {
        struct {
            uint64_t remote_addr;
            uint32_t rkey;
        } rdma;
        struct {
            uint64_t remote_addr;
            uint64_t compare_add;
            uint64_t swap;
            uint32_t rkey;
        } atomic;
        struct {
            struct ibv_ah *ah;
            uint32_t remote_qpn;
            uint32_t remote_qkey;
        } ud;
    } wr;
    union {
        struct {
            uint32_t remote_srqn;
        } xrc;
    } qp_type;
    union {
        struct {
            struct ibv_mw *mw;
            uint32_t rkey;
            struct ibv_mw_bind_info bind_info;
        } bind_mw;
        struct {
            void *hdr;
            uint16_t hdr_sz;
            uint16_t mss;
        } tso;
    };
};

struct ibv_recv_wr {
    uint64_t wr_id;
    struct ibv_recv_wr *next;
    struct ibv_sge *sg_list;
    int num_sge;
};

struct ibv_wc {
    uint64_t wr_id;
    int status;
    int opcode;
    uint32_t vendor_err;
    uint32_t byte_len;
    union {
        uint32_t imm_data;
        uint32_t invalidated_rkey;
    };
    uint32_t qp_num;
    uint32_t src_qp;
    unsigned int wc_flags;
    uint16_t pkey_index;
    uint16_t slid;
    uint8_t sl;
    uint8_t dlid_path_bits;
};

struct ibv_device **ibv_get_device_list(int *num_devices);
void ibv_free_device_list(struct ibv_device **list);
const char *ibv_get_device_name(struct ibv_device *device);
struct ibv_context *ibv_open_device(struct ibv_device *device);
int ibv_close_device(struct ibv_context *context);
int ibv_query_device(struct ibv_context *context, struct ibv_device_attr *device_attr);
int ibv_query_port(struct ibv_context *context, uint8_t port_num,
                   struct ibv_port_attr *port_attr);
int ibv_query_gid(struct ibv_context *context, uint8_t port_num, int index, union ibv_gid *gid);
ssize_t _ibv_query_gid_table(struct ibv_context *context, struct ibv_gid_entry *entries,
                             size_t max_entries, uint32_t flags, size_t entry_size);
struct ibv_pd *ibv_alloc_pd(struct ibv_context *context);
int ibv_dealloc_pd(struct ibv_pd *pd);
struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access);
int ibv_dereg_mr(struct ibv_mr *mr);
struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *context);
int ibv_destroy_comp_channel(struct ibv_comp_channel *channel);
struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context,
                             struct ibv_comp_channel *channel, int comp_vector);
int ibv_destroy_cq(struct ibv_cq *cq);
int ibv_get_cq_event(struct ibv_comp_channel *channel, struct ibv_cq **cq, void **cq_context);
void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents);
struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *qp_init_attr);
int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask,
                 struct ibv_qp_init_attr *init_attr);
int ibv_destroy_qp(struct ibv_qp *qp);
"""

#: Every struct and union declared above, by C name (the layout test walks these).
DECLARED_TYPES = (
    "pthread_mutex_t",
    "pthread_cond_t",
    "struct ibv_context_ops",
    "struct ibv_context",
    "struct ibv_device_attr",
    "struct ibv_port_attr",
    "union ibv_gid",
    "struct ibv_gid_entry",
    "struct ibv_pd",
    "struct ibv_mr",
    "struct ibv_comp_channel",
    "struct ibv_cq",
    "struct ibv_qp",
    "struct ibv_qp_cap",
    "struct ibv_qp_init_attr",
    "struct ibv_global_route",
    "struct ibv_ah_attr",
    "struct ibv_qp_attr",
    "struct ibv_sge",
    "struct ibv_mw_bind_info",
    "struct ibv_send_wr",
    "struct ibv_recv_wr",
    "struct ibv_wc",
)

LIBRARY = "libibverbs.so.1"

#: The function types of the ``struct ibv_context_ops`` slots hixl calls.
POLL_CQ = "int (*)(struct ibv_cq *, int, struct ibv_wc *)"
REQ_NOTIFY_CQ = "int (*)(struct ibv_cq *, int)"
POST_SEND = "int (*)(struct ibv_qp *, struct ibv_send_wr *, struct ibv_send_wr **)"
POST_RECV = "int (*)(struct ibv_qp *, struct ibv_recv_wr *, struct ibv_recv_wr **)"

#: Where ``make ffi`` writes the prebuilt tables (a module of this package).
TABLES_MODULE = "hixl.verbs._ffi_tables"


def parse() -> Any:
    """A new ``cffi.FFI`` with ``CDEF`` parsed (the slow way; the tables' reference)."""
    parsed = cffi.FFI()
    parsed.cdef(CDEF)
    return parsed


def write_tables(path: str) -> None:
    """Write cffi's out-of-line ABI module for ``CDEF`` to ``path`` (``make ffi``)."""
    import os
    import tempfile

    builder = parse()
    builder.set_source(TABLES_MODULE, None)
    with tempfile.TemporaryDirectory() as tmp:
        emitted = os.path.join(tmp, "tables.py")
        builder.emit_python_code(emitted)
        with open(emitted, encoding="utf-8") as f:
            text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write("# Generated from CDEF in hixl/verbs/_ffi.py by `make ffi`; do not edit.\n")
        f.write(text)


def _load() -> Any:
    try:
        from hixl.verbs._ffi_tables import ffi as prebuilt
    except Exception:  # noqa: BLE001 - a cffi that cannot read the tables: parse instead
        return parse()
    return prebuilt


ffi = _load()

_lib: Any = None
_lib_error: str | None = None
_lib_lock = threading.Lock()


def lib() -> Any:
    """The loaded ``libibverbs.so.1``; raises ``OSError`` when it cannot be opened."""
    global _lib, _lib_error
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is None:
            try:
                _lib = ffi.dlopen(LIBRARY)
            except OSError as exc:
                _lib_error = str(exc)
                raise
    return _lib


def address(cdata: Any) -> int:
    """The address a cdata pointer or array points to, as an int."""
    return int(ffi.cast("uintptr_t", cdata))
