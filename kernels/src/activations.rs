//! How a GPU backend hands f32 activations to its bf16 tensor-core products.
//!
//! The weights are exact in bf16 (FP8 e4m3 and FP4 e2m1 codes times power-of-two scales,
//! or BF16 as stored); only the activations lose bits. Two precisions:
//!
//! - [`Activations::Bf16`] (the default): each activation rounded once to bf16, f32 sums —
//!   what the reference model (transformers' DeepSeek-V4 in bf16) computes, and more than
//!   DeepSeek's own FP8 serving path keeps. One tensor-core product per GEMM.
//! - [`Activations::Split`]: `x = hi + lo`, two bf16 parts (~16 significant bits): the
//!   results stay at f32 distance from the CPU engine (the exact reference sluice tests
//!   against), for twice the tensor-core work and the parts' bytes. Conformance tests on
//!   tiny random models pin it: their logits lie so close together that one bf16
//!   rounding can change a greedy token.
//!
//! The CPU backend always computes in f32. The process default comes from
//! [`Activations::set_process_default`] (the services' `--activations` flag), else
//! `SLUICE_ACTIVATIONS`, else `Bf16`; a backend can be set apart before it loads weights.

use std::sync::atomic::{AtomicU8, Ordering};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Activations {
    /// Rounded once to bf16: the reference model's precision.
    #[default]
    Bf16,
    /// Two bf16 parts: f32 distance from the CPU engine.
    Split,
}

/// 0: not set; else 1 + the variant's index.
static PROCESS_DEFAULT: AtomicU8 = AtomicU8::new(0);

impl Activations {
    /// `bf16` or `split`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "bf16" => Ok(Activations::Bf16),
            "split" => Ok(Activations::Split),
            other => Err(format!(
                "`{other}` is not an activation precision; use bf16 (the reference model's, fastest) or split (f32 distance from the CPU engine)"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Activations::Bf16 => "bf16",
            Activations::Split => "split",
        }
    }

    /// What GPU backends made from now on in this process use.
    pub fn set_process_default(a: Activations) {
        PROCESS_DEFAULT.store(1 + a as u8, Ordering::Relaxed);
    }

    /// [`set_process_default`](Self::set_process_default)'s value, else
    /// `SLUICE_ACTIVATIONS` (`SLUICE_CUDA_BF16_ACTIVATIONS`, its older name, too), else
    /// `Bf16`. A value that parses as neither is reported once and ignored.
    pub fn process_default() -> Activations {
        match PROCESS_DEFAULT.load(Ordering::Relaxed) {
            1 => return Activations::Bf16,
            2 => return Activations::Split,
            _ => {}
        }
        static FROM_ENV: std::sync::OnceLock<Activations> = std::sync::OnceLock::new();
        *FROM_ENV.get_or_init(|| {
            let value =
                ["SLUICE_ACTIVATIONS", "SLUICE_CUDA_BF16_ACTIVATIONS"].iter().find_map(|k| std::env::var(k).ok());
            match value.as_deref().map(Activations::parse) {
                None => Activations::default(),
                Some(Ok(a)) => a,
                Some(Err(e)) => {
                    tracing::warn!("SLUICE_ACTIVATIONS: {e}; using bf16");
                    Activations::default()
                }
            }
        })
    }
}

impl std::str::FromStr for Activations {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Activations::parse(s)
    }
}

impl std::fmt::Display for Activations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_unknown_ones_say_what_to_use() {
        for a in [Activations::Bf16, Activations::Split] {
            assert_eq!(Activations::parse(a.name()), Ok(a));
            assert_eq!(a.to_string().parse::<Activations>(), Ok(a));
        }
        let e = Activations::parse("fp16").unwrap_err();
        assert!(e.contains("fp16") && e.contains("bf16") && e.contains("split"), "{e}");
        assert_eq!(Activations::default(), Activations::Bf16);
    }

    #[test]
    fn the_process_default_is_what_was_set_last() {
        Activations::set_process_default(Activations::Split);
        assert_eq!(Activations::process_default(), Activations::Split);
        Activations::set_process_default(Activations::Bf16);
        assert_eq!(Activations::process_default(), Activations::Bf16);
    }
}
