// The C yardstick of bench_kv --device: RDMA WRITEs of a KV request's bytes, in the
// request's number of work requests, from one process, timed by one clock (first post to
// last completion), on an RC queue pair per lane connected back to the same device.
//
// usage: kv_wr DEVICE GID_INDEX WRS SGES SGE_LEN SGE_STRIDE QPS REPS
//
// A request is WRS work requests, spread over QPS queue pairs in equal runs; each work
// request moves SGES * SGE_LEN bytes into one contiguous remote range.  Every
// configuration below moves those bytes in those work requests:
//   shape:   "1 SGE" (each WR one contiguous SGES * SGE_LEN source range) and, when
//            SGES > 1, the request's own shape ("SGES SGEs": SGE_LEN bytes each,
//            SGE_STRIDE apart on the source);
//   posting: "one thread" (one post list per queue pair, posted one after the other)
//            and, when QPS > 1, "thread per QP" (queue pair q > 0 posted by its own
//            thread, released together with the main thread, which posts queue pair 0);
//   waiting: "poll" (the main thread spins on the completion queue) and "event" (it
//            sleeps on a completion channel between polls).
// Only the last work request of each queue pair is signaled.  Each repetition writes
// fresh bytes into the source and clears the destination before the clock, and compares
// every byte after it (a mismatch ends the program with status 1).  Configurations take
// turns within each repetition, in reverse order every other one.
//
// Output, one line per configuration: "kv_wr<TAB>name<TAB>median seconds<TAB>bytes".
// Errors go to stderr with status 1 (2 for bad arguments).
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_QPS 16
#define MAX_CONFIGS 8

#define FAIL(...)                 \
  do {                            \
    fprintf(stderr, "kv_wr: ");   \
    fprintf(stderr, __VA_ARGS__); \
    fputc('\n', stderr);          \
    exit(1);                      \
  } while (0)

static double clock_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static long parse_arg(const char *text, const char *what, long lo, long hi) {
  char *end;
  long v = strtol(text, &end, 10);
  if (*text == '\0' || *end != '\0' || v < lo || v > hi) {
    fprintf(stderr, "kv_wr: %s must be an integer in [%ld, %ld], got '%s'\n", what, lo, hi,
            text);
    exit(2);
  }
  return v;
}

struct shape {  // one way of cutting the request into work requests
  int sges;
  struct ibv_sge *sge;  // WRS * sges entries
  struct ibv_send_wr *wr;  // WRS entries, linked per queue pair
};

struct config {
  char name[96];
  int shape, threads, event;
  double *times;
};

// Posting threads: queue pair q > 0 is posted by poster q, released by `go`.
static pthread_barrier_t go, posted;
static struct ibv_qp *qp_send[MAX_QPS];
static struct ibv_send_wr *heads[MAX_QPS];  // the list each poster posts this round
static volatile int stopping;

static void *poster(void *arg) {
  int q = (int)(intptr_t)arg;
  for (;;) {
    pthread_barrier_wait(&go);
    if (stopping) return NULL;
    struct ibv_send_wr *bad;
    if (ibv_post_send(qp_send[q], heads[q], &bad)) FAIL("ibv_post_send failed (QP %d)", q);
    pthread_barrier_wait(&posted);
  }
}

// Acknowledge events left on the channel by an earlier repetition (the queue stays armed
// after the last wait), so that a wait in this one sleeps until this one's completion.
static void drain_events(struct ibv_comp_channel *channel) {
  int flags = fcntl(channel->fd, F_GETFL);
  if (flags < 0 || fcntl(channel->fd, F_SETFL, flags | O_NONBLOCK) < 0) FAIL("fcntl failed");
  struct ibv_cq *ev_cq;
  void *ev_ctx;
  while (ibv_get_cq_event(channel, &ev_cq, &ev_ctx) == 0) ibv_ack_cq_events(ev_cq, 1);
  if (errno != EAGAIN && errno != EWOULDBLOCK) FAIL("ibv_get_cq_event failed");
  if (fcntl(channel->fd, F_SETFL, flags) < 0) FAIL("fcntl failed");
}

static void connect_qp(struct ibv_qp *qp, uint32_t dest, const union ibv_gid *gid, int gidx,
                       enum ibv_mtu mtu) {
  struct ibv_qp_attr at = {.qp_state = IBV_QPS_INIT, .port_num = 1,
                           .qp_access_flags = IBV_ACCESS_REMOTE_WRITE};
  if (ibv_modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                 IBV_QP_ACCESS_FLAGS))
    FAIL("QP to INIT failed");
  memset(&at, 0, sizeof at);
  at.qp_state = IBV_QPS_RTR;
  at.path_mtu = mtu;
  at.dest_qp_num = dest;
  at.max_dest_rd_atomic = 1;
  at.min_rnr_timer = 12;
  at.ah_attr.is_global = 1;
  at.ah_attr.grh.dgid = *gid;
  at.ah_attr.grh.sgid_index = (uint8_t)gidx;
  at.ah_attr.grh.hop_limit = 1;
  at.ah_attr.port_num = 1;
  if (ibv_modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                 IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                 IBV_QP_MIN_RNR_TIMER))
    FAIL("QP to RTR failed");
  memset(&at, 0, sizeof at);
  at.qp_state = IBV_QPS_RTS;
  at.timeout = 14;
  at.retry_cnt = 7;
  at.rnr_retry = 7;
  at.max_rd_atomic = 1;
  if (ibv_modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                 IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
    FAIL("QP to RTS failed");
}

int main(int argc, char **argv) {
  if (argc != 9) {
    fprintf(stderr, "usage: kv_wr DEVICE GID_INDEX WRS SGES SGE_LEN SGE_STRIDE QPS REPS\n");
    return 2;
  }
  const char *devname = argv[1];
  int gidx = (int)parse_arg(argv[2], "GID_INDEX", 0, 255);
  int wrs = (int)parse_arg(argv[3], "WRS", 1, 1 << 16);
  int sges = (int)parse_arg(argv[4], "SGES", 1, 64);
  size_t len = (size_t)parse_arg(argv[5], "SGE_LEN", 1, 1 << 24);
  size_t stride = (size_t)parse_arg(argv[6], "SGE_STRIDE", (long)len, 1L << 30);
  int qps = (int)parse_arg(argv[7], "QPS", 1, MAX_QPS);
  int reps = (int)parse_arg(argv[8], "REPS", 1, 1000);
  if (qps > wrs) qps = wrs;

  int ndev;
  struct ibv_device **list = ibv_get_device_list(&ndev);
  if (!list) FAIL("no RDMA devices (ibv_get_device_list failed)");
  struct ibv_context *ctx = NULL;
  for (int i = 0; i < ndev && !ctx; i++)
    if (!strcmp(ibv_get_device_name(list[i]), devname)) ctx = ibv_open_device(list[i]);
  if (!ctx) FAIL("cannot open RDMA device '%s'", devname);
  struct ibv_pd *pd = ibv_alloc_pd(ctx);
  struct ibv_port_attr port;
  union ibv_gid gid;
  if (!pd || ibv_query_port(ctx, 1, &port) || ibv_query_gid(ctx, 1, gidx, &gid))
    FAIL("cannot query port 1 / GID index %d of '%s'", gidx, devname);

  size_t per_wr = (size_t)sges * len;
  size_t src_per_wr = (size_t)(sges - 1) * stride + len;  // >= per_wr
  size_t src_len = (size_t)wrs * src_per_wr, dst_len = (size_t)wrs * per_wr;
  uint8_t *src = aligned_alloc(4096, (src_len + 4095) / 4096 * 4096);
  uint8_t *dst = aligned_alloc(4096, (dst_len + 4095) / 4096 * 4096);
  if (!src || !dst) FAIL("out of memory");
  memset(src, 0, src_len);
  memset(dst, 0, dst_len);
  struct ibv_mr *smr = ibv_reg_mr(pd, src, src_len, IBV_ACCESS_LOCAL_WRITE);
  struct ibv_mr *dmr =
      ibv_reg_mr(pd, dst, dst_len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!smr || !dmr) FAIL("ibv_reg_mr failed");
  struct ibv_comp_channel *channel = ibv_create_comp_channel(ctx);
  if (!channel) FAIL("ibv_create_comp_channel failed");
  struct ibv_cq *cq = ibv_create_cq(ctx, 2 * qps + 2, NULL, channel, 0);
  if (!cq) FAIL("ibv_create_cq failed");

  int per_qp = (wrs + qps - 1) / qps;
  struct ibv_qp *peer[MAX_QPS];
  for (int q = 0; q < qps; q++) {
    struct ibv_qp_init_attr ia = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
                                  .cap = {.max_send_wr = (uint32_t)per_qp + 1,
                                          .max_recv_wr = 1,
                                          .max_send_sge = (uint32_t)sges,
                                          .max_recv_sge = 1}};
    qp_send[q] = ibv_create_qp(pd, &ia);
    peer[q] = ibv_create_qp(pd, &ia);
    if (!qp_send[q] || !peer[q]) FAIL("ibv_create_qp failed (max_send_sge %d)", sges);
    connect_qp(qp_send[q], peer[q]->qp_num, &gid, gidx, port.active_mtu);
    connect_qp(peer[q], qp_send[q]->qp_num, &gid, gidx, port.active_mtu);
  }

  // The work requests of each shape; both write WR w to dst + w * per_wr.
  struct shape shapes[2];
  int nshapes = sges > 1 ? 2 : 1;
  for (int k = 0; k < nshapes; k++) {
    struct shape *s = &shapes[k];
    s->sges = k == 0 ? 1 : sges;
    s->sge = calloc((size_t)wrs * s->sges, sizeof *s->sge);
    s->wr = calloc((size_t)wrs, sizeof *s->wr);
    if (!s->sge || !s->wr) FAIL("out of memory");
    for (int w = 0; w < wrs; w++) {
      struct ibv_sge *g = &s->sge[(size_t)w * s->sges];
      for (int j = 0; j < s->sges; j++) {
        g[j].addr = (uintptr_t)(src + (size_t)w * src_per_wr + (size_t)j * stride);
        g[j].length = (uint32_t)(s->sges == 1 ? per_wr : len);
        g[j].lkey = smr->lkey;
      }
      int last = w == wrs - 1 || (w + 1) % per_qp == 0;
      s->wr[w].wr_id = (uint64_t)w;
      s->wr[w].sg_list = g;
      s->wr[w].num_sge = s->sges;
      s->wr[w].opcode = IBV_WR_RDMA_WRITE;
      s->wr[w].send_flags = last ? IBV_SEND_SIGNALED : 0;
      s->wr[w].next = last ? NULL : &s->wr[w + 1];
      s->wr[w].wr.rdma.remote_addr = (uintptr_t)(dst + (size_t)w * per_wr);
      s->wr[w].wr.rdma.rkey = dmr->rkey;
    }
  }
  // The 1-SGE shape reads each WR's bytes contiguously: its source range is per_wr long.
  // With SGES > 1 those ranges start src_per_wr apart, as the strided shape's do.

  struct config cfg[MAX_CONFIGS];
  int ncfg = 0;
  for (int k = 0; k < nshapes; k++)
    for (int t = 0; t < (qps > 1 ? 2 : 1); t++)
      for (int e = 0; e < 2; e++) {
        struct config *c = &cfg[ncfg++];
        snprintf(c->name, sizeof c->name, "%d WRs x %d SGE%s, %d QP%s, %s, %s", wrs,
                 shapes[k].sges, shapes[k].sges > 1 ? "s" : "", qps, qps > 1 ? "s" : "",
                 t ? "thread per QP" : "one thread", e ? "event" : "poll");
        c->shape = k;
        c->threads = t;
        c->event = e;
        c->times = calloc((size_t)reps, sizeof(double));
        if (!c->times) FAIL("out of memory");
      }

  pthread_t tid[MAX_QPS];
  if (qps > 1) {
    if (pthread_barrier_init(&go, NULL, (unsigned)qps) ||
        pthread_barrier_init(&posted, NULL, (unsigned)qps))
      FAIL("pthread_barrier_init failed");
    for (int q = 1; q < qps; q++)
      if (pthread_create(&tid[q], NULL, poster, (void *)(intptr_t)q))
        FAIL("pthread_create failed");
  }

  uint32_t seed = 12345;
  for (int r = 0; r < reps; r++) {
    for (int i = 0; i < ncfg; i++) {
      struct config *c = &cfg[r % 2 ? ncfg - 1 - i : i];
      struct shape *s = &shapes[c->shape];
      // fresh bytes where this shape reads, a clear destination; not timed
      for (int w = 0; w < wrs; w++)
        for (int j = 0; j < s->sges; j++) {
          uint8_t *p = (uint8_t *)(uintptr_t)s->sge[(size_t)w * s->sges + j].addr;
          size_t n = s->sge[(size_t)w * s->sges + j].length;
          for (size_t b = 0; b < n; b += 4) {
            seed = seed * 1664525u + 1013904223u;
            memcpy(p + b, &seed, n - b < 4 ? n - b : 4);
          }
        }
      memset(dst, 0, dst_len);
      for (int q = 0; q < qps; q++) heads[q] = &s->wr[(size_t)q * per_qp];
      int expect = qps;
      if (c->event) {
        drain_events(channel);
        if (ibv_req_notify_cq(cq, 0)) FAIL("ibv_req_notify_cq failed");
      }

      double t0 = clock_s();
      if (c->threads) {
        pthread_barrier_wait(&go);
        struct ibv_send_wr *bad;
        if (ibv_post_send(qp_send[0], heads[0], &bad)) FAIL("ibv_post_send failed (QP 0)");
      } else {
        for (int q = 0; q < qps; q++) {
          struct ibv_send_wr *bad;
          if (ibv_post_send(qp_send[q], heads[q], &bad)) FAIL("ibv_post_send failed (QP %d)", q);
        }
      }
      struct ibv_wc wc[MAX_QPS];
      while (expect > 0) {
        int got = ibv_poll_cq(cq, MAX_QPS, wc);
        if (got < 0) FAIL("ibv_poll_cq failed");
        for (int i2 = 0; i2 < got; i2++)
          if (wc[i2].status != IBV_WC_SUCCESS)
            FAIL("work completion status %s", ibv_wc_status_str(wc[i2].status));
        expect -= got;
        if (got == 0 && c->event) {
          struct ibv_cq *ev_cq;
          void *ev_ctx;
          if (ibv_get_cq_event(channel, &ev_cq, &ev_ctx)) FAIL("ibv_get_cq_event failed");
          ibv_ack_cq_events(ev_cq, 1);
          if (ibv_req_notify_cq(cq, 0)) FAIL("ibv_req_notify_cq failed");
        }
      }
      c->times[r] = clock_s() - t0;
      if (c->threads) pthread_barrier_wait(&posted);

      for (int w = 0; w < wrs; w++) {
        const uint8_t *d = dst + (size_t)w * per_wr;
        for (int j = 0; j < s->sges; j++) {
          const struct ibv_sge *g = &s->sge[(size_t)w * s->sges + j];
          if (memcmp(d, (const void *)(uintptr_t)g->addr, g->length))
            FAIL("bytes differ at WR %d SGE %d (%s)", w, j, c->name);
          d += g->length;
        }
      }
    }
  }
  if (qps > 1) {
    stopping = 1;
    pthread_barrier_wait(&go);
    for (int q = 1; q < qps; q++) pthread_join(tid[q], NULL);
  }
  for (int i = 0; i < ncfg; i++) {
    qsort(cfg[i].times, (size_t)reps, sizeof(double), by_value);
    printf("kv_wr\t%s\t%.9f\t%zu\n", cfg[i].name, cfg[i].times[reps / 2], dst_len);
  }
  return 0;
}
