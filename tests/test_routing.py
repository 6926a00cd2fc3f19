"""Routing decisions of quanta.cluster.routing: pure functions, no Ray, no server."""

import pytest

from quanta.cluster.routing import PrefixRouter, ReplicaLoad, make_router

B = 8  # block size of these tests


def idle(n):
    return [ReplicaLoad(0, 0)] * n


def prompt(tag, blocks, extra=0):
    """``blocks`` full blocks of ids derived from ``tag`` plus ``extra`` loose tokens."""
    return [hash((tag, i)) % 30_000 + 1 for i in range(blocks * B + extra)]


def route(router, tokens, loads):
    r = router.choose(tokens, loads)
    router.routed(r, tokens)
    return r


def test_pure_affinity_follows_the_longest_match_over_load():
    router = make_router("prefix", 3, block_size=B, max_waiting=4, load_tokens=0)
    a, b = prompt("a", 4), prompt("b", 4)
    router.routed(2, a)
    router.routed(1, a[:2 * B])  # replica 1 holds a shorter run of a's blocks
    router.routed(0, b)
    loads = [ReplicaLoad(0, 0), ReplicaLoad(0, 1), ReplicaLoad(3, 2)]  # replica 2 the busiest
    assert router.choose(a + prompt("tail", 1), loads) == 2
    assert router.choose(a[:2 * B] + prompt("x", 2), loads) == 1  # 1 and 2 tie at two blocks: 1 is less loaded
    assert router.choose(b, loads) == 0


def test_no_match_and_short_prompts_go_to_the_least_loaded():
    router = make_router("prefix", 3, block_size=B)
    router.routed(0, prompt("a", 3))
    loads = [ReplicaLoad(0, 2), ReplicaLoad(1, 0), ReplicaLoad(0, 3)]
    assert router.choose(prompt("new", 3), loads) == 1  # fewest requests (1), not fewest waiting
    assert router.choose(prompt("a", 0, extra=B - 1), loads) == 1  # under one block: nothing to match


def test_prefix_falls_back_to_least_loaded_past_max_waiting():
    router = make_router("prefix", 2, block_size=B, max_waiting=2, load_tokens=0)
    a = prompt("a", 4)
    router.routed(0, a)
    assert router.choose(a, [ReplicaLoad(2, 4), ReplicaLoad(0, 0)]) == 0  # at the bound: affinity holds
    assert router.choose(a, [ReplicaLoad(3, 0), ReplicaLoad(0, 2)]) == 1  # past it: least-loaded
    assert router.choose(a, [ReplicaLoad(3, 0), ReplicaLoad(0, 5)]) == 0  # which may be the preferred one


def test_ties_break_by_waiting_then_lowest_index():
    router = make_router("least-loaded", 4)
    assert router.choose([1], [ReplicaLoad(1, 1), ReplicaLoad(0, 2), ReplicaLoad(0, 2), ReplicaLoad(2, 1)]) == 1
    assert router.choose([1], idle(4)) == 0
    prefix = make_router("prefix", 3, block_size=B)
    a = prompt("a", 2)
    prefix.routed(1, a)
    prefix.routed(2, a)
    assert prefix.choose(a, idle(3)) == 1  # tied holders, equal loads: lowest index


def test_round_robin_cycles_in_order_whatever_the_load():
    router = make_router("round-robin", 3)
    busy = [ReplicaLoad(9, 9), ReplicaLoad(0, 0), ReplicaLoad(0, 0)]
    assert [route(router, prompt("a", 2), busy) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    router.routed(2, [1])  # a dispatch elsewhere than chosen: the cycle continues from there
    assert router.choose([1], busy) == 0


def test_choose_changes_nothing():
    for name in ("prefix", "least-loaded", "round-robin"):
        router = make_router(name, 2, block_size=B)
        assert [router.choose(prompt("a", 2), idle(2)) for _ in range(3)] == [0, 0, 0]


def test_memory_bound_forgets_least_recently_routed_first():
    router = PrefixRouter(2, block_size=B, max_blocks=6)
    a, b = prompt("a", 4), prompt("b", 4)
    router.routed(0, a)
    router.routed(0, b)  # 8 names > 6: two of a's go, its tail first
    assert router.held_blocks(0) == 6
    assert router.depths(a) == (4, [2, 0])  # a's first two blocks survive, a run from block 0
    assert router.depths(b) == (4, [4, 0])
    for i in range(50):
        router.routed(0, prompt(i, 3))
    assert router.held_blocks(0) == 6
    assert router.depths(a) == (4, [0, 0])
    assert len(router._holders) == 6  # forgotten names leave the shared index too


def test_sessions_stick_to_their_replica_under_prefix_and_spread_under_round_robin():
    """Three sessions of growing prompts on two replicas (load: requests routed so far): prefix routing
    keeps each session where it began and spreads new sessions; round-robin moves each session."""
    def run(name):
        router, history, count = make_router(name, 2, block_size=B, load_tokens=0), {}, [0, 0]
        for turn in range(4):
            for s in range(3):
                r = route(router, prompt(s, 2 + 3 * turn), [ReplicaLoad(0, c) for c in count])
                count[r] += 1
                history.setdefault(s, []).append(r)
        return history

    prefix = run("prefix")
    assert prefix == {0: [0] * 4, 1: [1] * 4, 2: [0] * 4}
    assert all(len(set(h)) == 2 for h in run("round-robin").values())


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_router("random", 2)
    with pytest.raises(ValueError, match="replicas must be at least 1"):
        make_router("prefix", 0)
    with pytest.raises(ValueError, match="expected the loads of 2 replicas, got 3"):
        make_router("prefix", 2).choose([1], idle(3))


def test_a_shared_prefix_spills_to_another_replica_once_the_queue_outweighs_it():
    """Sessions whose prompts share 12 blocks (96 tokens) and differ in 1: each in-flight request is worth
    32 tokens, so the holder takes new sessions until 3 are in flight (its cost 8 + 3 x 32 = 104 >= 104,
    the other's cost to compute the whole prompt); from then on both hold the prefix and cost is load."""
    router = make_router("prefix", 2, block_size=B, load_tokens=32)
    shared = prompt("system", 12)
    loads = [0, 0]
    chosen = []
    for s in range(6):
        r = route(router, shared + prompt(("user", s), 1), [ReplicaLoad(0, n) for n in loads])
        loads[r] += 1
        chosen.append(r)
    assert chosen == [0, 0, 0, 1, 1, 1]  # the 4th ties at 104 and goes to the less loaded; then 1 holds it too
    pure = make_router("prefix", 2, block_size=B, load_tokens=0)
    loads = [0, 0]
    for s in range(6):
        r = route(pure, shared + prompt(("user", s), 1), [ReplicaLoad(0, n) for n in loads])
        loads[r] += 1
    assert loads == [6, 0]  # pure affinity never spills before max_waiting


def test_cost_counts_the_tokens_a_replica_would_compute():
    router = PrefixRouter(2, block_size=B, load_tokens=10)
    a = prompt("a", 6)
    router.routed(0, a[:4 * B])  # replica 0 holds 4 of a's 6 blocks
    assert router.depths(a) == (6, [4, 0])
    assert router.choose(a, [ReplicaLoad(0, 1), ReplicaLoad(0, 0)]) == 0  # 16 + 10 < 48
    assert router.choose(a, [ReplicaLoad(0, 4), ReplicaLoad(0, 0)]) == 1  # 16 + 40 > 48


def test_front_config_reports_prefix_routings_settings():
    from quanta.cluster.front import Front

    def config(router, routing):
        front = Front([None, None], router, None, max_num_seqs=8, max_request_bytes=None, routing=routing)
        return front._config({0: {"model": "m"}, 1: {"model": "m"}})["cluster"]

    prefix = config(PrefixRouter(2, max_waiting=3, load_tokens=512), "prefix")
    assert (prefix["routing"], prefix["max_waiting"], prefix["load_tokens"]) == ("prefix", 3, 512)
    assert "load_tokens" not in config(make_router("round-robin", 2), "round-robin")


def test_the_default_price_of_a_queued_request_is_the_mean_routed_prompt():
    """Coding agents: 10 shared blocks and 2 of their own (96 tokens), so the mean prompt is 96 tokens and a
    second session on the holder (cost 16 + 96) outweighs computing the whole prompt on the idle replica
    (96): sessions alternate, and both replicas hold the shared prefix after two sessions."""
    router = make_router("prefix", 2, block_size=B)
    assert router.load_price(prompt("x", 3)) == 3 * B  # nothing routed yet: the prompt's own length
    shared, loads, chosen = prompt("system", 10), [0, 0], []
    for s in range(4):
        r = route(router, shared + prompt(("user", s), 2), [ReplicaLoad(0, n) for n in loads])
        loads[r] += 1
        chosen.append(r)
    assert chosen == [0, 1, 0, 1]
    assert router.load_price([]) == 12 * B
    router.routed(0, prompt("long", 28))  # a 224-token prompt: the mean is now (4 x 96 + 224) / 5
    assert router.load_price([]) == (4 * 12 * B + 28 * B) // 5
