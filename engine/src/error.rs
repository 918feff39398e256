//! The engine crate's boundary error.

use thiserror::Error;

use crate::checkpoint::CheckpointError;
use crate::config::ConfigError;
use crate::kv::{ImportError, PoolError};

#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Import(#[from] ImportError),
    #[error("token id {token} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("sequence would reach {tokens} tokens, past the model's context limit of {limit}")]
    ContextTooLong { tokens: usize, limit: usize },
    #[error("a step needs at least one token for every sequence in it")]
    EmptyInput,
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("the KV pools do not fit the devices: {0}")]
    Pools(String),
}

impl EngineError {
    /// Errors caused by the request itself (bad tokens, too long), as opposed to
    /// capacity or a broken model.
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            EngineError::TokenOutOfRange { .. }
                | EngineError::ContextTooLong { .. }
                | EngineError::EmptyInput
                | EngineError::InvalidRequest(_)
        )
    }
}
