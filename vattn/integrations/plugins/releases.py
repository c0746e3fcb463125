"""The releases vattn hooks, and the source fingerprint of every function (or class) each
release's patch hooks (`hunks.fingerprint` of its source as installed from the release's
wheel). A release not listed here is refused; a listed one whose installed function has
another fingerprint is refused too. `tests/test_plugins_releases.py` (slow) recomputes this
table from each release's wheel."""
from __future__ import annotations

FINGERPRINTS: dict[str, dict[str, dict[str, str]]] = {
    "vllm": {
        "0.32.0": {
            "vllm.v1.core.block_pool:BlockPool.__init__": "8396305301984209",
            "vllm.v1.core.block_pool:BlockPool.get_new_blocks": "e30e4bbc287b5989",
            "vllm.v1.core.block_pool:BlockPool.free_blocks": "4535fb67a3ed304a",
            "vllm.v1.core.block_pool:BlockPool.reset_prefix_cache": "675e34d29addf7fe",
            "vllm.v1.core.block_pool:BlockPool.get_num_free_blocks": "03f8b7189539cc13",
            "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator.__init__": "0e816e2b8714efa7",
            "vllm.v1.core.kv_cache_utils:get_kv_cache_config_from_groups": "596d87668864494e",
            "vllm.v1.core.sched.output:SchedulerOutput": "c1829c19cd075870",
            "vllm.v1.core.sched.scheduler:Scheduler.schedule": "9ba0a4e5e57745c0",
            "vllm.v1.worker.utils:allocate_kv_cache": "21848da388478d6d",
            "vllm.v1.worker.gpu_worker:Worker.execute_model": "77742cd5c8d60286",
            "vllm.v1.engine.core:EngineCore._initialize_kv_caches": "0f15f2ca05e33ddf",
            "vllm.v1.engine.core:EngineCore.step": "a4d753d3ba6a6d76",
            "vllm.v1.engine.core:EngineCore.step_with_batch_queue": "c2a1f9e6af2f5855",
            "vllm.v1.engine.core:EngineCoreProc._process_input_queue": "877492857a426bb0",
        },
        "0.33.0": {
            "vllm.v1.core.block_pool:BlockPool.__init__": "eb5694c104945360",
            "vllm.v1.core.block_pool:BlockPool.get_new_blocks": "e30e4bbc287b5989",
            "vllm.v1.core.block_pool:BlockPool.free_blocks": "8eb1ebebfcec94ff",
            "vllm.v1.core.block_pool:BlockPool.reset_prefix_cache": "675e34d29addf7fe",
            "vllm.v1.core.block_pool:BlockPool.get_num_free_blocks": "03f8b7189539cc13",
            "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator.__init__": "40cc98fa14cfb46e",
            "vllm.v1.core.kv_cache_planning:get_kv_cache_config_from_groups": "596d87668864494e",
            "vllm.v1.core.sched.output:SchedulerOutput": "88c10573da76fefe",
            "vllm.v1.core.sched.scheduler:Scheduler.schedule": "c14d1b25e51ba444",
            "vllm.v1.worker.utils:allocate_kv_cache": "21848da388478d6d",
            "vllm.v1.worker.gpu_worker:Worker.execute_model": "77742cd5c8d60286",
            "vllm.v1.engine.core:EngineCore._initialize_kv_caches": "dbcb1c11cd54faad",
            "vllm.v1.engine.core:EngineCore.step": "a4d753d3ba6a6d76",
            "vllm.v1.engine.core:EngineCore.step_with_batch_queue": "c2a1f9e6af2f5855",
            "vllm.v1.engine.core:EngineCoreProc._process_input_queue": "c78526e58fbfd219",
        },
    },
    "sglang": {
        "0.5.22": {
            "sglang.srt.managers.scheduler:Scheduler.on_idle": "8ab3f3067c4cc3ab",
            "sglang.srt.managers.scheduler_components.invariant_checker:SchedulerInvariantChecker._check_full_pool": "ffab4f4929af34e9",
            "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.available_size": "8e376e028803c174",
            "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.alloc": "f68def26fbc26a31",
            "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.alloc_extend": "b784426e2b64cb93",
            "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.alloc_decode": "c04fc540e54bca51",
            "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.clear": "28feb09339f35ef6",
            "sglang.srt.mem_cache.allocator.token:TokenToKVPoolAllocator.clear": "ea19e703195fb365",
            "sglang.srt.mem_cache.allocator.token:TokenToKVPoolAllocator.available_size": "ebe799670427ba6f",
            "sglang.srt.mem_cache.allocator.token:TokenToKVPoolAllocator.alloc": "a5a48e96671d36b4",
            "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator._init_pools": "073bc4d28bc15015",
            "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator._build_mha_kv_pool": "56832c8bf45fbd72",
            "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool.__init__": "ac716896791fb35c",
            "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool._create_buffers_normal": "08c8343b1dcb2076",
        },
        "0.5.23": {
            "sglang.srt.managers.scheduler:Scheduler.on_idle": "8ab3f3067c4cc3ab",
            "sglang.srt.managers.scheduler_components.invariant_checker:SchedulerInvariantChecker._check_full_pool": "ffab4f4929af34e9",
            "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.available_size": "8e376e028803c174",
            "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.alloc": "f68def26fbc26a31",
            "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.alloc_extend": "b784426e2b64cb93",
            "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.alloc_decode": "c04fc540e54bca51",
            "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.clear": "28feb09339f35ef6",
            "sglang.srt.mem_cache.allocator.token:TokenToKVPoolAllocator.clear": "ea19e703195fb365",
            "sglang.srt.mem_cache.allocator.token:TokenToKVPoolAllocator.available_size": "ebe799670427ba6f",
            "sglang.srt.mem_cache.allocator.token:TokenToKVPoolAllocator.alloc": "a5a48e96671d36b4",
            "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator._init_pools": "7bceb6a705bb778b",
            "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator._build_mha_kv_pool": "56832c8bf45fbd72",
            "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool.__init__": "037fd431dfcd7e76",
            "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool._create_buffers_normal": "67fb060c271527d4",
        },
    },
}
