#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| coordinator::fuzzing::flow_config(data));
