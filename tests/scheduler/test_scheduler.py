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
    """Applies a schedule as the engine would: computed tokens advance; completed chunks emit a token."""
    out = sched.schedule()
    for chunk in out.chunks:
        completes = chunk.completes_sequence
        chunk.seq.num_computed_tokens += chunk.num_new_tokens
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
