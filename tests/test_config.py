"""Flags -> one frozen Config: every SPEC §2 flag, refusals that name the flag and the fix."""

from __future__ import annotations

import argparse

import pytest

from radianced.config import (
    DEFAULT_HEADROOM_MIB, KV_CACHE_DTYPES, NOT_YET_SUPPORTED, Config, ConfigError, add_flags, parse_config,
)

MiB = 1 << 20


def test_defaults_are_the_documented_ones():
    c = parse_config([])
    assert c == Config()
    assert (c.model, c.max_model_len, c.placement, c.embedding_placement, c.kv_cache_dtype) == \
        (None, 0, "auto", None, "auto")
    assert c.embedding_table == "ram"
    assert c.headroom_mib == DEFAULT_HEADROOM_MIB == 96
    assert c.headroom_bytes(8192 * MiB) == 96 * MiB
    assert c.lending and c.state_copies == 1 and c.decode_tokens == c.max_num_seqs


def test_every_card_split_flag_parses_into_its_field():
    argv = ("--model m.rad --gpu-headroom-mib 128 --max-model-len 32768 --max-num-batched-tokens 4096 "
            "--max-num-seqs 4 --host-pool-mib 65536 --placement expert_tiered --deterministic "
            "--weights-disk-tier --kv-cache-dtype auto --embedding-placement vram --expert-slots 100 "
            "--drain-timeout 5.5 --card-mib 32607 --host 0.0.0.0 --port 9000 --http-socket /run/r.sock "
            "--control-socket /run/c.sock --api-key k --max-queue 10 --served-model-name qwen").split()
    c = parse_config(argv)
    assert (c.model, c.gpu_headroom_mib, c.max_model_len, c.max_num_batched_tokens, c.max_num_seqs) == \
        ("m.rad", 128, 32768, 4096, 4)
    assert (c.host_pool_mib, c.placement, c.deterministic, c.weights_disk_tier) == (65536, "expert_tiered", True, True)
    assert (c.embedding_placement, c.expert_slots, c.drain_timeout, c.card_mib) == ("vram", 100, 5.5, 32607)
    assert (c.host, c.port, c.http_socket, c.control_socket, c.api_key, c.max_queue, c.served_model_name) == \
        ("0.0.0.0", 9000, "/run/r.sock", "/run/c.sock", "k", 10, "qwen")
    assert not c.lending  # --deterministic turns lending off
    assert c.embedding_table == "vram"  # the flag beats the default


def test_gpu_memory_mib_is_the_headroom_written_as_a_claim():
    c = parse_config(["--gpu-memory-mib", "30000"])
    assert c.headroom_bytes(32607 * MiB) == 2607 * MiB


def test_headroom_and_memory_claim_are_mutually_exclusive():
    with pytest.raises(ConfigError, match="^--gpu-headroom-mib and --gpu-memory-mib are mutually exclusive: give one$"):
        parse_config(["--gpu-headroom-mib", "96", "--gpu-memory-mib", "30000"])


@pytest.mark.parametrize("argv, message", [
    ("--gpu-headroom-mib -1", "--gpu-headroom-mib -1: must be between 0 and 16777216"),
    ("--gpu-memory-mib 0", "--gpu-memory-mib 0: must be between 1 and 16777216"),
    ("--max-model-len -5", "--max-model-len -5: must be between 0 and 16777216"),
    ("--max-model-len 99999999", "--max-model-len 99999999: must be between 0 and 16777216"),
    ("--max-num-seqs 0", "--max-num-seqs 0: must be between 1 and 65536"),
    ("--max-num-batched-tokens 0", "--max-num-batched-tokens 0: must be between 1 and 1048576"),
    ("--host-pool-mib -1", "--host-pool-mib -1: must be between 0 and 67108864"),
    ("--expert-slots -3", "--expert-slots -3: must be between 0 and 16777216"),
    ("--port 70000", "--port 70000: must be between 0 and 65535"),
    ("--card-mib 0", "--card-mib 0: must be between 1 and 16777216"),
    ("--drain-timeout -1", "--drain-timeout -1.0: must be between 0 and 86400 seconds"),
    ("--drain-timeout nan", "--drain-timeout nan: must be between 0 and 86400 seconds"),
    ("--api-key  ", "--api-key: empty; give a value or leave the flag out"),
])
def test_negative_or_absurd_values_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_config(argv.split(" ", 1)[:1] + [argv.split(" ", 1)[1]])
    assert str(e.value) == message


def test_a_step_must_decode_every_live_sequence():
    with pytest.raises(ConfigError, match=r"--max-num-batched-tokens 8: a step must decode one token for each of "
                                          r"--max-num-seqs 16; give at least 16"):
        parse_config(["--max-num-batched-tokens", "8"])


def test_resident_contradicts_the_disk_tier_and_a_slot_cap():
    with pytest.raises(ConfigError,
                       match="--placement resident keeps every expert on the card; drop --weights-disk-tier"):
        parse_config(["--placement", "resident", "--weights-disk-tier"])
    with pytest.raises(ConfigError, match="--placement resident gives every expert a slot; drop --expert-slots"):
        parse_config(["--placement", "resident", "--expert-slots", "4"])


@pytest.mark.parametrize("flag, value", [
    ("--kv-resident", "65536"), ("--ngram-placement", "ram=/dev/shm"),
    ("--vision-tower-placement", "vram"),
])
def test_flags_of_later_issues_parse_and_are_refused_as_not_yet_supported(flag, value):
    assert flag in NOT_YET_SUPPORTED
    with pytest.raises(ConfigError, match=f"^{flag}: not yet supported"):
        parse_config([flag, value])


def test_speculative_drafts_with_the_mtp_head_where_the_model_has_one():
    c = parse_config(["--speculative", "4"])
    assert (c.speculative, c.speculative_method, c.state_copies) == (4, "auto", 5)
    assert c.drafts_with_mtp(1) and not c.drafts_with_mtp(0)  # auto: mtp where the model has MTP layers
    ngram = parse_config(["--speculative", "2", "--speculative-method", "ngram"])
    assert not ngram.drafts_with_mtp(1)
    assert not parse_config(["--speculative-method", "mtp"]).drafts_with_mtp(1)  # no drafting: nothing to run
    with pytest.raises(ConfigError, match="--speculative-method"):
        parse_config(["--speculative-method", "eagle"])


def test_the_off_value_of_an_unlanded_flag_passes():
    c = parse_config(["--speculative", "0", "--kv-resident", "0"])
    assert (c.speculative, c.kv_resident) == (0, 0)


@pytest.mark.parametrize("dtype", ["fp8", "fp8_v4", "k6_v4"])
def test_quantized_kv_cache_dtypes_are_accepted(dtype):
    assert parse_config(["--kv-cache-dtype", dtype]).kv_cache_dtype == dtype


def test_every_quantized_kv_cache_dtype_has_a_format():
    from radianced.kernels.kv_formats import KV_FORMATS

    assert ("auto", *KV_FORMATS) == KV_CACHE_DTYPES


def test_a_config_built_directly_may_carry_an_unlanded_feature_for_planning():
    c = Config(speculative=1, kv_resident=1000)  # values checked, landing not: the budget plans with them
    assert (c.state_copies, c.decode_tokens, c.kv_resident_tokens) == (2, 32, 32768)


def test_bad_values_of_unlanded_flags_are_refused_as_bad_values_first():
    with pytest.raises(ConfigError, match="--ngram-placement 'tmpfs': choose vram, ram, disk, ram=DIR or disk=DIR"):
        parse_config(["--ngram-placement", "tmpfs"])
    with pytest.raises(ConfigError, match="--speculative 17: must be between 0 and 16"):
        parse_config(["--speculative", "17"])


def test_a_table_placement_outside_the_choices_is_refused_naming_the_flag():
    for field, flag in (("embedding_placement", "--embedding-placement"),
                        ("vision_tower_placement", "--vision-tower-placement")):
        with pytest.raises(ConfigError, match=f"^{flag} 'disk': choose one of vram, ram$"):
            Config(**{field: "disk"})


def test_parser_errors_are_config_errors_not_exits():
    with pytest.raises(ConfigError, match="--port: invalid int value: 'abc'"):
        parse_config(["--port", "abc"])
    with pytest.raises(ConfigError, match="invalid choice: 'everywhere'"):
        parse_config(["--placement", "everywhere"])
    with pytest.raises(ConfigError, match="unrecognized arguments: --gpu-util"):
        parse_config(["--gpu-util", "0.9"])


def test_a_cli_adds_the_flags_to_its_own_parser_and_keeps_its_own():
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-level", default="info")
    add_flags(parser)
    ns = parser.parse_args(["--log-level", "debug", "--max-num-seqs", "3"])
    c = Config.from_args(ns)
    assert c.max_num_seqs == 3 and not hasattr(c, "log_level")


def test_config_is_frozen():
    c = Config()
    with pytest.raises(AttributeError):
        c.max_num_seqs = 4
