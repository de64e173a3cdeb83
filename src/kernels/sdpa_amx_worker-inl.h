// sdpa_amx_worker-inl.h — the AMX forward's per-thread pipeline: a call's tensors (Call) and the
// Worker that fetches a thread's units (its tasks in groups, key block by key block) and runs them
// through the tile stream and the softmax. Included by sdpa_amx-inl.h inside its namespace amx,
// after sdpa_amx_rows-inl.h.

// The tensors of one call.
struct Call {
  const SdpaProblem& pb;
  const Layout& lay;
  const Tensor &q, &k, &v, &out;
  float* lse;
  float* weights;
  int64_t n_qb, n_tasks, run;
  int64_t group;  // tasks per group (at most kGroup)
  std::atomic<int64_t>* next;  // the first task not yet handed out
};

// One thread's pipeline. Its units (a task's key blocks, tasks in runs handed out from a shared
// counter) go through three steps: S = Q · Kᵀ on tiles, the softmax in AVX-512, O += P · V on
// tiles. Phase u exponentiates unit u while the tiles compute S of unit u + 1 and P · V of unit
// u - 1; the two tile jobs are spread between the rows of the softmax (TileStream), so the
// TMUL and the vector units run side by side. Then the task of unit u - 1 is finished if that was
// its last block, and O of unit u's task is rescaled by u's alpha (unit u - 1, if of that task,
// has been added). Every task is computed the same way whatever the thread or its neighbours.
class Worker {
 public:
  Worker(const Call& call, const Scratch& scr) : c_(call), scr_(scr) {}

  void run() {
    Unit prev, cur = fetch();
    if (!cur) return;
    {
      ensure_k(task(cur), scr_, cur.j0 + cur.nkp);
      TileStream ts;
      add_scores(ts, task(cur), scr_, cur.j0, cur.nkp, scr_.s[0]);
      ts.finish();
    }
    int cb = 0;  // unit u's S and P are s[u % 2] and p[u % 2]
    while (cur) {
      const Unit next = fetch();
      TileStream ts;
      if (next) {
        ensure_k(task(next), scr_, next.j0 + next.nkp);
        add_scores(ts, task(next), scr_, next.j0, next.nkp, scr_.s[1 - cb]);
      }
      if (prev) {
        ensure_v(task(prev), scr_, prev.j0 + prev.nkp);
        add_products(ts, task(prev), scr_, prev, scr_.p[1 - cb]);
      }
      const bool rescale = softmax_unit(task(cur), scr_, cur, scr_.s[cb], scr_.p[cb], ts);
      if (prev && prev.last) finish(prev.slot);
      if (!cur.first && rescale) rescale_o(task(cur), scr_, cur.slot);
      prev = cur;
      cur = next;
      cb ^= 1;
    }
    TileStream ts;
    ensure_v(task(prev), scr_, prev.j0 + prev.nkp);
    add_products(ts, task(prev), scr_, prev, scr_.p[1 - cb]);
    ts.finish();
    finish(prev.slot);  // the thread's last unit is its task's last
  }

 private:
  const Task& task(const Unit& u) const { return *slots_[u.slot]; }

  // The next task handed to this thread (-1: none left): runs of c_.run tasks from the counter.
  int64_t next_task() {
    if (run_next_ == run_end_) {
      run_next_ = c_.next->fetch_add(c_.run, std::memory_order_relaxed);
      run_end_ = std::min(run_next_ + c_.run, c_.n_tasks);
      if (run_next_ >= c_.n_tasks) {
        run_next_ = run_end_ = 0;
        return -1;
      }
    }
    return run_next_++;
  }

  // Describes task `id` in `slot` and begins it.
  void describe(int64_t id, int slot) {
    const SdpaProblem& pb = c_.pb;
    const int64_t n_qb = c_.n_qb, bh = id / n_qb, b = bh / pb.H, h = bh % pb.H;
    const int64_t qb = pb.causal ? n_qb - 1 - id % n_qb : id % n_qb;  // heaviest first
    const int64_t i0 = qb * kBQ, nq = std::min(pb.Lq - i0, kBQ), hk = h / pb.group();
    const Tensor &q = c_.q, &k = c_.k, &v = c_.v, &out = c_.out;
    const uint16_t* qrows = static_cast<const uint16_t*>(q.raw_data()) + b * q.stride(0) + h * q.stride(1) + i0 * q.stride(2);
    slots_[slot].emplace(Task{pb, c_.lay, b, h, hk, i0, nq, pb.has_left || pb.mods.any(),
                              static_cast<const uint16_t*>(k.raw_data()) + b * k.stride(0) + hk * k.stride(1), k.stride(2),
                              static_cast<const uint16_t*>(v.raw_data()) + b * v.stride(0) + hk * v.stride(1), v.stride(2),
                              qrows, q.stride(2), q_in_place(pb, nq) ? qrows : scr_.qp[slot],
                              q_in_place(pb, nq) ? q.stride(2) : c_.lay.Dp,
                              static_cast<uint16_t*>(out.raw_data()) + b * out.stride(0) + h * out.stride(1) + i0 * out.stride(2),
                              out.stride(2), c_.lse + (b * pb.H + h) * pb.Lq + i0,
                              c_.weights ? c_.weights + ((b * pb.H + h) * pb.Lq + i0) * pb.Lk : nullptr,
                              // keys left of the first row's window are skipped (the band's limits grow with i)
                              pb.key_begin(i0) / 32 * 32, pb.key_end(i0 + nq - 1)});
    begin_task(*slots_[slot], scr_, slot);
  }

  // A free task slot (there is always one: kSlots bounds the tasks in flight).
  int take_slot() {
    for (int i = 0; i < kSlots; ++i) {
      if (!slots_[i]) return i;
    }
    HEADS_CHECK(false, "sdpa (amx): no free task slot");
    return -1;
  }
  void finish(int slot) {
    finish_task(*slots_[slot], scr_, slot);
    slots_[slot].reset();
  }

  // The next unit: the group's next (task, key block), tasks in order within a key block; when the
  // group is done, the next group's first. Tasks without a key block are finished as they are
  // described. None when the thread's tasks are done.
  Unit fetch() {
    for (;;) {
      for (; group_j0_ < group_jend_; group_j0_ += kBK, group_next_ = 0) {
        while (group_next_ < group_n_) {
          const int slot = group_[group_next_++];
          const Task& t = *slots_[slot];
          if (group_j0_ < t.jstart || group_j0_ >= t.jend) continue;
          Unit u;
          u.slot = slot;
          u.j0 = group_j0_;
          u.nk = std::min(t.jend - group_j0_, kBK);
          u.nkp = (u.nk + 31) / 32 * 32;
          u.first = group_j0_ == t.jstart;
          u.last = group_j0_ + kBK >= t.jend;
          return u;
        }
      }
      if (!next_group()) return Unit{};
    }
  }

  // Describes the next group: up to c_.group of the thread's next tasks on one (b, h) that have key
  // blocks. False when none is left.
  bool next_group() {
    for (;;) {
      fill_group();
      if (group_n_ > 0) return true;
      if (pending_ < 0) return false;  // (tasks of one head without key blocks, another head's next)
    }
  }
  void fill_group() {
    group_n_ = 0;
    group_next_ = 0;
    group_j0_ = std::numeric_limits<int64_t>::max();
    group_jend_ = 0;
    int64_t bh0 = -1;
    while (group_n_ < c_.group) {
      const int64_t id = pending_ >= 0 ? pending_ : next_task();
      pending_ = -1;
      if (id < 0) break;
      const int64_t bh = id / c_.n_qb;
      if (!c_.pb.head_on(bh / c_.pb.H, bh % c_.pb.H)) continue;  // a head turned off: cleared by the caller
      if (bh0 >= 0 && bh != bh0) {
        pending_ = id;  // another head: the next group's
        break;
      }
      bh0 = bh;
      const int slot = take_slot();
      describe(id, slot);
      const Task& t = *slots_[slot];
      if (t.jstart >= t.jend) {
        finish(slot);  // no key block: finished now
        continue;
      }
      group_[group_n_++] = slot;
      group_j0_ = std::min(group_j0_, t.jstart);
      group_jend_ = std::max(group_jend_, t.jend);
    }
  }

  const Call& c_;
  const Scratch& scr_;
  std::optional<Task> slots_[kSlots];
  int group_[kGroup] = {};  // the group's slots, in task order
  int group_n_ = 0, group_next_ = 0;  // its tasks; the next one to look at on block group_j0_
  int64_t group_j0_ = 0, group_jend_ = 0;  // the key block being handed out; the end of the group's
  int64_t pending_ = -1;  // a task taken from the counter for the next group (another head's)
  int64_t run_next_ = 0, run_end_ = 0;
};
