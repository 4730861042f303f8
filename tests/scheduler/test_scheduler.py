from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import SamplingParams, Sequence, SequenceStatus


def seq(seq_id: int, n: int) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        prompt_token_ids=list(range(n)),
        params=SamplingParams(),
    )


def run_step(sched: Scheduler):
    """Applies a schedule as the engine would: computed tokens advance, pages past the window
    (if any) are released, completed chunks emit a token."""
    out = sched.schedule()
    for chunk in out.chunks:
        completes = chunk.completes_sequence
        chunk.seq.num_computed_tokens += chunk.num_new_tokens
        sched.block_manager.release_passed(chunk.seq)
        if completes:
            chunk.seq.output_token_ids.append(7)
    return out


def test_chunked_prefill_under_token_budget_with_decodes_first():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), BlockManager(32, 4))
    a, b = seq(1, 3), seq(2, 20)
    sched.add(a)
    out = run_step(sched)
    assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [(1, 3)]
    sched.add(b)
    out = run_step(sched)  # a decodes 1 token, b prefills 7 of 20
    assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [(1, 1), (2, 7)]
    assert b.block_table == list(range(1, 6))  # b's whole prompt is reserved at admission
    out = run_step(sched)
    assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [(1, 1), (2, 7)]
    out = run_step(sched)
    assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [(1, 1), (2, 6)]
    assert out.chunks[1].seq.num_output_tokens == 1


def test_admission_waits_until_pages_fit_with_reserve():
    sched = Scheduler(SchedulerConfig(reserve_pages=1), BlockManager(4, 4))
    a, b = seq(1, 8), seq(2, 8)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [s.seq_id for s in out.admitted] == [1]  # b needs 2 pages + 1 reserve; 2 are free
    assert b.status is SequenceStatus.WAITING
    sched.finish(a)
    out = run_step(sched)
    assert [s.seq_id for s in out.admitted] == [2]


def test_the_reserve_is_not_kept_while_nothing_runs():
    """A prompt that fits the pool only without the reserve had waited for good, and
    everything queued behind it with it."""
    sched = Scheduler(SchedulerConfig(reserve_pages=1), BlockManager(4, 4))
    big, small = seq(1, 16), seq(2, 2)
    sched.add(big)
    sched.add(small)
    out = run_step(sched)
    assert [s.seq_id for s in out.admitted] == [1]  # all 4 pages: nothing else runs
    assert big.block_table == [0, 1, 2, 3]
    assert small.status is SequenceStatus.WAITING  # 1 page + 1 reserve, none free
    sched.finish(big)
    assert [s.seq_id for s in run_step(sched).admitted] == [2]


def test_a_preempted_sequence_grown_past_pool_minus_reserve_is_readmitted():
    """b is preempted with 9 tokens (3 pages): with the reserve it needs 5 of the pool's 4
    pages, so it had waited for good once a finished."""
    bm = BlockManager(4, 4)
    sched = Scheduler(SchedulerConfig(reserve_pages=2), bm)
    a, b = seq(1, 2), seq(2, 2)
    sched.add(a)
    sched.add(b)
    assert [s.seq_id for s in run_step(sched).admitted] == [1, 2]  # b: 1 page + 2 reserve
    preempted = []
    while not preempted:  # both grow by a token a step until a needs a third page
        preempted = run_step(sched).preempted
    assert preempted == [b] and b.num_tokens == 9 and b.status is SequenceStatus.WAITING
    assert (a.num_tokens, a.block_table) == (10, [0, 2, 1])
    sched.finish(a)
    out = run_step(sched)
    assert [s.seq_id for s in out.admitted] == [2]  # 3 pages, no reserve while none runs
    assert [(ch.seq.seq_id, ch.num_new_tokens) for ch in out.chunks] == [(2, 9)]
    assert b.block_table == [3, 0, 2]


def test_out_of_pages_preempts_the_newest_and_requeues_it_first():
    bm = BlockManager(3, 4)
    sched = Scheduler(SchedulerConfig(), bm)
    a, b = seq(1, 4), seq(2, 4)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: pages 0 and 1; each emitted a token (5 tokens, need 2 pages)
    out = run_step(sched)  # a takes page 2; b finds none and is preempted
    assert [c.seq.seq_id for c in out.chunks] == [1]
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b] and sched.num_preemptions == 1
    assert a.block_table == [0, 2]
    sched.finish(a)
    out = run_step(sched)  # b recomputes prompt + its token
    assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [(2, 5)]
    assert bm.page_owner.tolist()[:2] == [(2 << 16) | 1] * 2  # new generation after preemption


def test_max_num_seqs_caps_the_running_set():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2), BlockManager(16, 4))
    for i in range(3):
        sched.add(seq(i + 1, 2))
    out = run_step(sched)
    assert [s.seq_id for s in out.admitted] == [1, 2] and len(sched.waiting) == 1


def chunks(out) -> list[tuple[int, int]]:
    return [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks]


def fair(**kw) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, long_prefill_tokens=4, **kw),
        BlockManager(64, 4),
    )


def test_a_short_prompt_behind_a_long_prefill_is_admitted_in_the_next_step():
    sched = fair()
    a, b = seq(1, 40), seq(2, 3)
    sched.add(a)
    assert chunks(run_step(sched)) == [(1, 16)]  # alone: all the budget
    sched.add(b)
    # a is held to its 4 while b waits; b takes 3; the 9 left go back to a
    out = run_step(sched)
    assert out.admitted == [b] and chunks(out) == [(1, 13), (2, 3)]
    assert b.num_output_tokens == 1
    assert chunks(run_step(sched)) == [(2, 1), (1, 11)]  # b's decode first, then a's rest


def test_short_prompts_pass_a_waiting_long_one_which_gets_the_budget_left():
    sched = fair()
    a, c, d = seq(1, 24), seq(2, 40), seq(3, 2)
    sched.add(a)
    assert chunks(run_step(sched)) == [(1, 16)]  # a has 8 left: still long
    sched.add(c)
    sched.add(d)
    # one long prefill at a time: c is passed over for d; a finishes its 8; c gets the 6 left
    out = run_step(sched)
    assert chunks(out) == [(1, 8), (3, 2), (2, 6)]
    assert out.admitted == [d, c] and not sched.waiting


def test_fair_prefill_off_keeps_arrival_order_and_whole_chunks():
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, long_prefill_tokens=0), BlockManager(64, 4)
    )
    a, b = seq(1, 40), seq(2, 3)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    out = run_step(sched)
    assert chunks(out) == [(1, 16)] and list(sched.waiting) == [b]


def test_a_long_prefill_keeps_its_share_under_a_stream_of_short_prompts():
    sched = fair(max_num_seqs=256)
    a = seq(1, 200)
    sched.add(a)
    next_id = 2
    taken = []
    while a.num_output_tokens == 0:
        for _ in range(5):  # 15 prompt tokens a step: alone they would fill the budget
            sched.add(seq(next_id, 3))
            next_id += 1
        out = run_step(sched)
        taken.append(dict(chunks(out)).get(1, 0))
        for s in list(sched.running):  # the short ones are one-token requests
            if s is not a and s.num_output_tokens:
                sched.finish(s)
    assert min(taken) >= 4 and sum(taken) == 200
    assert len(taken) <= 50  # 4 a step at the least


def test_a_passed_over_long_prompt_that_does_not_fit_holds_the_queue():
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, long_prefill_tokens=4), BlockManager(10, 4)
    )
    a, c, d = seq(1, 24), seq(2, 40), seq(3, 2)
    sched.add(a)
    run_step(sched)  # a holds 6 of the 10 pages
    sched.add(c)  # needs 10 pages: waits for memory
    sched.add(d)  # would fit, but does not take memory c waits for
    out = run_step(sched)
    assert chunks(out) == [(1, 8)] and list(sched.waiting) == [c, d]


def chunks_of(out) -> list[tuple[int, int]]:
    return [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks]


def held(s: Sequence) -> list[int]:
    return s.block_table[s.num_released_pages :]


def test_a_windowed_pool_admits_with_the_first_chunks_pages_and_releases_as_it_goes():
    """Window 8, pages of 4: a 30-token prompt is admitted with its first chunk's 2 pages,
    not its 8, and after each chunk the pages before the next query's window go back."""
    bm = BlockManager(8, 4, window=8)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, long_prefill_tokens=0), bm)
    a = seq(1, 30)
    sched.add(a)
    steps = [run_step(sched) for _ in range(5)]
    assert [chunks_of(out) for out in steps] == [[(1, 8)], [(1, 8)], [(1, 8)], [(1, 6)], [(1, 1)]]
    assert a.num_computed_tokens == 31 and a.num_released_pages == 6
    assert held(a) == [6, 7] and bm.num_free_pages == 6
    # step by step: (held pages, released columns, free pages) after each step
    bm2 = BlockManager(8, 4, window=8)
    sched2 = Scheduler(SchedulerConfig(max_num_batched_tokens=8, long_prefill_tokens=0), bm2)
    b = seq(2, 30)
    sched2.add(b)
    trace = []
    for _ in range(4):
        run_step(sched2)
        trace.append((held(b), b.num_released_pages, bm2.num_free_pages))
    assert trace == [([0, 1], 0, 6), ([2, 3], 2, 6), ([4, 5], 4, 6), ([5, 6, 7], 5, 5)]


def test_a_windowed_chunk_shrinks_to_the_free_pages_and_the_spare_budget_preempts_no_one():
    bm = BlockManager(4, 4, window=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, long_prefill_tokens=0), bm)
    a, b = seq(1, 3), seq(2, 40)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    steps = [run_step(sched) for _ in range(3)]
    # b is admitted with the 12 tokens its 3 free pages hold, then takes 4 a step: a
    # decodes first, and what is free after it is one page.
    assert [chunks_of(out) for out in steps] == [
        [(1, 1), (2, 12)],
        [(1, 1), (2, 4)],
        [(1, 1), (2, 4)],
    ]
    assert sched.num_preemptions == 0
    assert (held(a), held(b), bm.num_free_pages) == ([0, 1], [3], 1)


def test_a_lone_windowed_sequence_runs_a_prompt_longer_than_the_pool():
    """Window 8, pages of 4: a sequence holds at most ceil(7 / 4) + 1 = 3 pages while it
    computes a token at a time, so a pool of 3 pages (12 tokens) runs a 40-token prompt."""
    bm = BlockManager(3, 4, window=8)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, long_prefill_tokens=0), bm)
    a = seq(1, 40)
    sched.add(a)
    sizes, pages = [], []
    while a.num_output_tokens < 10:
        out = run_step(sched)
        sizes.append(out.chunks[0].num_new_tokens)
        pages.append(a.num_held_pages)
    assert sizes == [12] + [4] * 7 + [1] * 9
    assert pages == [2] * 8 + [3, 3, 2, 2, 3, 3, 2, 2, 3]
    assert sched.num_preemptions == 0 and bm.max_held_pages(1) == 3


def test_a_preempted_windowed_sequence_waits_for_its_windows_pages():
    """Two sequences that each need 3 pages of a 4-page pool: the newer is preempted when
    the older grows, and is not re-admitted on one free page only to be preempted again."""
    bm = BlockManager(4, 4, window=8)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, long_prefill_tokens=0), bm)
    a, b = seq(1, 6), seq(2, 6)
    sched.add(a)
    sched.add(b)
    steps = [run_step(sched) for _ in range(12)]
    assert [chunks_of(out) for out in steps[:4]] == [
        [(1, 6), (2, 6)], [(1, 1), (2, 1)], [(1, 1), (2, 1)], [(1, 1)],
    ]  # fmt: skip
    assert [[s.seq_id for s in out.preempted] for out in steps] == [[]] * 3 + [[2]] + [[]] * 8
    assert all(chunks_of(out) == [(1, 1)] for out in steps[4:])
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert held(a) == [2, 3, 0] and bm.num_free_pages == 1
    sched.finish(a)
    out = run_step(sched)
    assert chunks_of(out) == [(2, 9)]  # recomputes its 6 prompt tokens and 3 outputs
    assert [s.seq_id for s in out.admitted] == [2]


def test_a_windowed_sequence_that_keeps_its_pages_is_admitted_with_them_all():
    bm = BlockManager(8, 4, window=8)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, long_prefill_tokens=0), bm)
    kept, windowed = seq(1, 20), seq(2, 20)
    kept.keeps_pages = True
    sched.add(kept)
    sched.add(windowed)
    out = run_step(sched)
    assert chunks_of(out) == [(1, 8)]  # the budget's 8 tokens; pages for all 20
    assert kept.block_table == [0, 1, 2, 3, 4] and windowed.status is SequenceStatus.WAITING
    run_step(sched)
    run_step(sched)
    assert kept.num_computed_tokens == 20 and kept.num_released_pages == 0
