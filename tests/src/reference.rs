//! What a cluster's answers are checked against: the CPU engine run in the test process
//! on the same model.

use engine::generate::{GenerateRequest, Generation, generate};
use engine::sampling::SamplingParams;
use engine::{CpuBackend, Engine};

use crate::Generated;

/// Greedy generation of `max_tokens` tokens after `prompt` on the in-process engine.
pub fn cold(engine: &mut Engine<CpuBackend>, prompt: &[u32], max_tokens: usize) -> Generation {
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        max_tokens,
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
    };
    tokio::task::block_in_place(|| generate(engine, &req, |_| {})).expect("in-process generation")
}

/// The cluster's answer has the engine's greedy tokens and its logprobs within `tol`.
pub fn assert_close(got: &Generated, want: &Generation, tol: f32, what: &str) {
    let ids: Vec<u32> = want.tokens.iter().map(|s| s.token).collect();
    assert_eq!(got.ids(), ids, "{what}: greedy tokens differ from the CPU engine");
    for (i, (g, w)) in got.logprobs().iter().zip(want.tokens.iter().map(|s| s.logprob)).enumerate() {
        assert!((g - w).abs() <= tol, "{what}: logprob {i} is {g}, the CPU engine's {w}");
    }
}
