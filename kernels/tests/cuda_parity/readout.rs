//! The greedy read-out picked on the device (cu/readout.cu: a row read in parts by many
//! blocks, then combined) against the host's pick (`kernels::backend::greedy_pick`, what
//! the engine's sampler computes), on rows built to meet the combine's edge cases.

use super::*;

/// The row's token must be the host's; its log-probability within one f32 step of the
/// host's (both sum in f64, in different orders), or NaN where the host's is.
fn same_pick(what: &str, got: (u32, f32), want: (u32, f32)) {
    assert_eq!(got.0, want.0, "{what}: device token {} against the host's {}", got.0, want.0);
    if want.1.is_nan() {
        assert!(got.1.is_nan(), "{what}: log-probability {} where the host's is NaN", got.1);
    } else {
        let ulps = (got.1.to_bits() as i64 - want.1.to_bits() as i64).abs();
        assert!(ulps <= 1, "{what}: log-probability {} against the host's {} ({ulps} f32 steps)", got.1, want.1);
    }
}

#[test]
fn cuda_greedy_readout_matches_the_host_on_edge_rows() {
    let Some(g) = gpu("cuda_greedy_readout_matches_the_host_on_edge_rows") else { return };
    let g = &*g;
    let mut rng = rng("greedy readout");
    for vocab in [100, 32_768, 129_280] {
        let noise = |rng: &mut ChaCha8Rng| rand_vec(rng, vocab, 4.0);
        let mut rows: Vec<(&str, Vec<f32>)> = Vec::new();
        rows.push(("random", noise(&mut rng)));
        // The maximum twice, in different parts (and blocks): the first one is the token.
        let mut tie = noise(&mut rng);
        tie[vocab - 1] = 50.0;
        tie[vocab / 3] = 50.0;
        rows.push(("tie", tie));
        // The maximum in the last value.
        let mut last = noise(&mut rng);
        last[vocab - 1] = 60.0;
        rows.push(("last", last));
        // A NaN first: the host keeps index 0; a NaN later: the sum is NaN.
        let mut nan_first = noise(&mut rng);
        nan_first[0] = f32::NAN;
        rows.push(("nan first", nan_first));
        let mut nan_later = noise(&mut rng);
        nan_later[vocab / 2] = f32::NAN;
        rows.push(("nan later", nan_later));
        // -inf over the first half (whole parts without a finite value), finite after.
        let mut masked = noise(&mut rng);
        masked[..vocab / 2].iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
        rows.push(("half -inf", masked));
        rows.push(("all -inf", vec![f32::NEG_INFINITY; vocab]));
        let flat: Vec<f32> = rows.iter().flat_map(|(_, r)| r.iter().copied()).collect();
        let got = g.greedy_rows(&g.upload(&flat), rows.len(), vocab);
        assert_eq!(got.len(), rows.len());
        for ((what, row), got) in rows.iter().zip(got) {
            same_pick(&format!("vocab {vocab}, {what}"), got, kernels::backend::greedy_pick(row));
        }
        eprintln!("PARITY greedy_readout vocab={vocab} f32 ok");
    }
}
