"""Scheduler with a KV connector (a scripted one): external tokens wait for their load,
count as computed once it lands, are recomputed when it fails; a producer's finished
request keeps its blocks until the consumer pulled them; nothing leaks."""

from __future__ import annotations

from engine.core.interfaces.kv_connector import KVConnectorBase
from engine.core.request import RequestStatus
from engine.core.scheduler.output import KVConnectorOutput, ModelRunnerOutput
from tests.core.test_scheduler import BS, TOKEN, add, assert_all_free, make_request, make_scheduler


class ScriptedConnector(KVConnectorBase):
    """Offers ``external[rid]`` tokens asynchronously; holds finished requests in ``hold``."""

    name = "scripted"
    metadata_cls = dict

    def __init__(self, external=None, hold=()):
        super().__init__(None, None)
        self.external = dict(external or {})
        self.hold = set(hold)
        self.allocated: dict[str, tuple[list[int], int]] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.external.get(request.request_id, 0), True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocated[request.request_id] = (list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return {}

    def request_finished(self, request, block_ids):
        rid = request.request_id
        return (rid in self.hold), ({"remote_block_ids": block_ids} if rid in self.hold else None)

    def register_kv_caches(self, kv_caches, layout):
        pass

    def start_load_kv(self):
        pass


def _step(s, connector_output=None):
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[TOKEN] if (r := s.get_request(rid)) and r.num_computed_tokens >= r.num_tokens
               else [] for rid in ids]
    outs = s.update_from_output(so, ModelRunnerOutput(ids, sampled,
                                                      kv_connector_output=connector_output))
    return so, {o.request_id: o for o in outs}


def test_external_tokens_wait_for_their_load_then_count_as_computed():
    connector = ScriptedConnector(external={"a": 100})
    s = make_scheduler(kv_connector=connector, max_model_len=128)
    add(s, make_request("a", 20, max_tokens=2))
    so, _ = _step(s)
    request = s.get_request("a")
    assert so.is_empty and request.status == RequestStatus.WAITING_FOR_REMOTE_KV
    blocks, external = connector.allocated["a"]
    assert external == 19  # capped: the last prompt token is computed here
    assert len(blocks) == -(-19 // BS)
    so, _ = _step(s)  # still loading: nothing runs
    assert so.is_empty
    _step(s, KVConnectorOutput(finished_recving=["a"]))  # the load lands
    so, outs = _step(s)
    assert so.num_scheduled_tokens == {"a": 1}  # only the last prompt token
    assert outs["a"].new_token_ids == [TOKEN] and outs["a"].num_cached_tokens == 19
    while s.has_unfinished_requests():
        _step(s)
    assert_all_free(s)


def test_failed_load_is_recomputed_into_the_same_blocks():
    connector = ScriptedConnector(external={"a": 100})
    s = make_scheduler(kv_connector=connector, max_model_len=128)
    add(s, make_request("a", 20, max_tokens=2))
    _step(s)
    _step(s, KVConnectorOutput(failed_loads=["a"]))
    so, _ = _step(s)
    assert so.num_scheduled_tokens == {"a": 20}  # the whole prompt, computed here
    while s.has_unfinished_requests():
        _step(s)
    assert_all_free(s)


def test_producer_holds_blocks_until_the_consumer_pulled_them():
    connector = ScriptedConnector(hold={"a"})
    s = make_scheduler(kv_connector=connector)
    add(s, make_request("a", 10, max_tokens=1))
    _, outs = _step(s)
    assert outs["a"].finished
    kv = s.kv_cache_manager
    held = kv.get_block_ids("a")[0]
    assert len(held) == -(-10 // BS)
    assert outs["a"].kv_transfer_params == {"remote_block_ids": held}
    assert kv.num_free_blocks < kv.num_usable_blocks  # held for the consumer
    assert s.has_unfinished_requests()  # the steps keep polling the connector
    _step(s, KVConnectorOutput(finished_sending=["a"]))
    assert not s.has_unfinished_requests()
    assert_all_free(s)


def test_abort_while_loading_frees_the_blocks_only_when_the_load_ends():
    connector = ScriptedConnector(external={"a": 100})
    s = make_scheduler(kv_connector=connector, max_model_len=128)
    add(s, make_request("a", 20, max_tokens=2))
    _step(s)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    kv = s.kv_cache_manager
    assert kv.num_free_blocks < kv.num_usable_blocks  # the load may still write them
    _step(s, KVConnectorOutput(finished_recving=["a"]))
    assert_all_free(s)
    assert not s.has_unfinished_requests()
